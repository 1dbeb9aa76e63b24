"""The command line a new user meets first: `--help` exits 0 and says how to list the config's
fields, `--print_config` lists them with their comments, and a misspelt field, a missing config
file or a bad variant is one line on stderr, not a traceback."""
import os
import subprocess
import sys

import pytest

from lrl import cli, config_util
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")


def _main(*args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = xla_env.SPEED_FLAGS  # one CPU device (a user's laptop), fast compiles
    return subprocess.run([sys.executable, "-m", "lrl.main", *args], cwd=ROOT,
                          timeout=timeout, capture_output=True, text=True, env=env)


def test_help_exits_zero_and_says_how_to_list_the_fields():
    out = _main("--help", timeout=60)
    assert out.returncode == 0, out.stderr
    for needle in ("--config=", "--workdir=", "--config.FIELD=VALUE", "--print_config",
                   "--verbosity", "configs/default.py", "configs/qwen2_5_math.py"):
        assert needle in out.stdout, needle
    out = _main("--helpfull", timeout=60)
    assert out.returncode == 0 and "--verbosity" in out.stdout and "--workdir" in out.stdout


@pytest.mark.parametrize("override,suggestion", [
    ("--config.rl.group_sise=16", "--config.rl.group_size"),
    ("--config.group_size=16", "--config.rl.group_size"),   # the section left out
])
def test_unknown_config_field_is_one_line_naming_the_nearest(tmp_path, override, suggestion):
    out = _main("--config=configs/default.py", f"--workdir={tmp_path}", override, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"did you mean {suggestion}?" in lines[0] and "--print_config" in lines[0]


def test_bad_config_file_and_bad_variant_are_one_line(tmp_path):
    for spec, needle in (("configs/no_such.py", "No such file"),
                         ("configs/default.py:nope", "unknown argument 'nope'")):
        out = _main(f"--config={spec}", f"--workdir={tmp_path}", timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert needle in out.stderr


def test_print_config_lists_every_resolved_field_with_its_comment():
    out = _main("--config=configs/default.py:runlocal", "--print_config",
                "--config.rl.steps=7", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    config = config_util.load(DEFAULT, "runlocal")
    config.rl.steps = 7
    for field, value in cli.flat_fields(config).items():
        assert any(line.startswith(f"{field} = {value!r}") for line in lines), field
    group = next(line for line in lines if line.startswith("rl.group_size = "))
    assert "# G: a larger group" in group  # the comment configs/default.py gives it
    fused = next(line for line in lines if line.startswith("rl.fused_head = "))
    assert "GSPO goes unfused" in fused  # a comment continued on the next line
