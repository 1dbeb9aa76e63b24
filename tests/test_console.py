"""What a new user meets first: requirements.txt covers every import of lrl/, and a run's
console is a banner, progress lines, held-out evals, an ETA from the phase's recent steps and a
closing summary, without the libraries' INFO chatter (which `--verbosity` brings back)."""
import ast
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from lrl import console
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported by lrl/ but deliberately not in requirements.txt, with the reason.
OPTIONAL = {"torch": "lrl.export --format=torch only; requirements-dev.txt has it",
            "wandb": "lrl.wandb_sink, only with metrics.wandb_project; requirements-dev.txt has "
                     "it for the sink's offline test"}
# Not imported by lrl/, but needed at run time by what it calls.
RUNTIME_ONLY = {"jinja2": "transformers renders the chat template with it"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(path: str) -> set[str]:
    names = set()
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                names.add(_norm(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]))
    return names


def _third_party_imports() -> dict[str, set[str]]:
    """{top-level module: {files}} of every import in lrl/ (functions' included)."""
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "lrl")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    top = m.split(".")[0]
                    if top != "lrl" and top not in sys.stdlib_module_names:
                        found.setdefault(top, set()).add(os.path.relpath(path, ROOT))
    return found


def test_requirements_cover_every_third_party_import_of_lrl():
    have = _requirements(os.path.join(ROOT, "requirements.txt"))
    dists = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"jax", "orbax", "transformers", "absl"} <= set(imports)  # the scan sees them
    missing = {}
    for module, files in sorted(imports.items()):
        if module in OPTIONAL:
            continue
        names = {_norm(d) for d in dists.get(module, [module])}
        if not names & have:
            missing[module] = (sorted(names), sorted(files)[:3])
    assert not missing, f"imported by lrl/ but not in requirements.txt: {missing}"
    for name in RUNTIME_ONLY:
        assert name in have, f"{name} ({RUNTIME_ONLY[name]}) is missing from requirements.txt"
    for name in OPTIONAL:  # requirements.txt must not pull torch (CI caps it; it is GBs)
        assert name not in have
    assert set(OPTIONAL) <= _requirements(os.path.join(ROOT, "requirements-dev.txt"))


def _main(*args, timeout=600, **env_vars):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_vars}
    env["XLA_FLAGS"] = xla_env.SPEED_FLAGS  # one CPU device (a user's laptop), fast compiles
    return subprocess.run([sys.executable, "-m", "lrl.main", *args], cwd=ROOT,
                          timeout=timeout, capture_output=True, text=True, env=env)


# ----------------------------------------------------------------------------- the ETA

def test_eta_is_the_median_of_recent_steps_plus_the_evals_left():
    assert console.eta_seconds([], 10) is None  # no step but the compile one yet
    assert console.eta_seconds([21.0, 9.5], 78) is None  # the next ones may still compile
    assert console.eta_seconds([1.0] * 5, 10) == pytest.approx(10.0)
    # SFT-speed steps long ago do not set the pace of slower recent ones.
    assert console.eta_seconds([0.8] * 300 + [3.0] * 10, 80) == pytest.approx(240.0)
    # One slow step (a checkpoint save) does not move a median.
    assert console.eta_seconds([3.0] * 9 + [30.0], 10) == pytest.approx(30.0)
    assert console.eta_seconds([3.0] * 5, 20, eval_s=[6.0, 8.0], remaining_evals=2) == \
        pytest.approx(60.0 + 14.0)
    assert console.eta_seconds([3.0], 0) == 0.0
    assert console.evals_left(3, 80, 10) == 8
    assert console.evals_left(75, 80, 10) == 1
    assert console.evals_left(0, 3, 2) == 2  # step 2, and the last step
    assert console.evals_left(5, 80, 0) == 0


def _simulate(progress, start, steps, step_s, first_s, phase, eval_every=0, eval_s=0.0,
              baseline=False):
    """Feeds `progress` a phase's steps; returns {local step: line} of the printed ones."""
    lines = {}
    if baseline:
        lines[0] = progress.line(start, phase, {"eval/reward/mean": 0.38, "eval/pass@1": 0.38,
                                                "eval/pass@4": 0.7}, 20.0)
    for s in range(1, steps + 1):
        scalars = {"loss": 1.0, "reward/mean": 0.5, "grad_norm": 0.3}
        t = first_s if s == 1 else step_s
        if eval_every and (s % eval_every == 0 or s == steps):
            scalars.update({"eval/reward/mean": 0.5, "eval/pass@4": 0.8})
            t += eval_s
        line = progress.line(start + s, phase, scalars, t)
        if line is not None:
            lines[s] = line
    return lines


def test_progress_of_the_default_run_shape():
    """300 SFT steps then 80 GRPO steps with a held-out eval every 10: how many lines, and
    ETAs from each phase's own pace (the old ETA said 0:06:12 at GRPO step 300 of 380 from
    SFT's 0.8 s steps, when 17.5 minutes were left)."""
    p = console.Progress({"sft": 300, "grpo": 80})
    banner = p.begin("sft", 0, "a step: 8 rows")
    assert "a line every 10 steps" in banner
    sft = _simulate(p, 0, 300, 0.8, 10.0, "sft")
    assert sorted(sft) == [1] + list(range(10, 301, 10))
    assert "first step: compiles" in sft[1] and "ETA" not in sft[1]
    assert "ETA 3:52" in sft[10]  # 290 steps x 0.8 s; not 10 s x 299 from the compile step
    p.begin("grpo", 0, "a step: 16 x 16", eval_every=10)
    grpo = _simulate(p, 300, 80, 3.0, 20.0, "grpo", eval_every=10, eval_s=6.0, baseline=True)
    assert sorted(grpo) == list(range(0, 81))
    assert "held-out reward 0.38 pass@4 0.7 before step 1" in grpo[0]
    assert "held-out reward 0.5" in grpo[10] and "held-out" not in grpo[11]
    # After step 30: 50 steps x 3 s and 5 evals x 6 s.
    assert "ETA 3:00" in grpo[30]
    assert "ETA" not in grpo[80]
    assert len(sft) + len(grpo) + 2 <= 120


def test_a_step_with_equal_rewards_in_every_group_says_so():
    p = console.Progress({"grpo": 3})
    line = p.line(1, "grpo", {"reward/mean": 0.0, "loss": 0.0, "grad_norm": 0.0,
                              "advantage/abs_mean": 0.0}, 5.0)
    assert "every group's rewards equal: no gradient" in line


def test_print_every():
    assert console.print_every(80, None) == 1
    assert console.print_every(50, 30) == 1
    assert console.print_every(100, 30) == 5
    assert console.print_every(300, 30) == 10
    assert console.print_every(2000, 30) == 100


def test_summary_says_before_and_after_and_where_everything_is(tmp_path):
    for d in ("tb", "tokenizer", "checkpoints/360", "checkpoints/380"):
        os.makedirs(tmp_path / d)
    (tmp_path / "metrics.jsonl").write_text("")
    rows = ([{"step": s, "phase": "sft", "loss": 5.0 - s / 100, "time/step_s": 0.8}
             for s in range(1, 301)] +
            [{"step": 300, "phase": "grpo", "eval/reward/mean": 0.38, "time/step_s": 20.0}] +
            [{"step": 300 + s, "phase": "grpo", "reward/mean": 0.5, "time/step_s": 3.0,
              **({"eval/reward/mean": 0.53} if s % 10 == 0 else {})} for s in range(1, 81)])
    lines = console.summary_lines(rows, str(tmp_path), 600.0, {"sft": 300, "grpo": 80})
    text = "\n".join(lines)
    assert lines[0].startswith("== done in 10:00: 300 SFT steps in 4:00")
    assert "80 GRPO steps in 4:20" in lines[0]
    assert "held-out reward 0.38 before step 1 -> 0.53 after step 80" in text
    for name in ("metrics.jsonl", "tb/", "tokenizer/", "checkpoints/"):
        assert f"     {name}" in text, name
    assert "steps 360, 380" in text and "python -m lrl.export --checkpoint=" in text
    assert "sft_curves.png" not in text  # only what exists is listed
    short = console.summary_lines(rows[:150], str(tmp_path), 60.0, {"sft": 300, "grpo": 80})
    assert "(stopped early: 150 of 300)" in short[0]


# ----------------------------------------------------------------------------- logging

@pytest.fixture
def absl_stream(capsys):
    """What absl's handler writes (to stderr here: flags are not parsed in the suite);
    levels, formatter and handlers are restored afterwards."""
    from absl import logging as absl_logging
    handler = absl_logging.get_absl_handler()
    root = logging.getLogger()
    saved = (handler.python_handler.formatter, list(handler.filters), root.level,
             logging.getLogger("lrl").level, list(root.handlers))
    if handler not in root.handlers:
        root.addHandler(handler)
    capsys.readouterr()

    def read():
        return [x for x in capsys.readouterr().err.splitlines()
                if "Logging before flag parsing" not in x]
    yield read
    fmt, filters, level, lrl_level, handlers = saved
    handler.python_handler.setFormatter(fmt)
    handler.filters[:] = filters
    root.setLevel(level)
    root.handlers[:] = handlers
    logging.getLogger("lrl").setLevel(lrl_level)


def test_quiet_logging_keeps_lrl_and_warnings_drops_library_info(absl_stream):
    from absl import logging as absl_logging
    console.setup_logging(verbose=False)
    absl_logging.info("orbax-style chatter")          # what orbax logs hundreds of times
    logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
    absl_logging.warning("Given directory is read only=/x")  # harmless, by name
    logging.getLogger("lrl.loop").info("resumed from /x (step 40)")
    logging.getLogger("lrl.build").warning("warm-up cut")
    assert absl_stream() == ["resumed from /x (step 40)", "warning: warm-up cut"]


def test_verbose_logging_leaves_library_info_on(absl_stream):
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.INFO)   # what `--verbosity=0` sets
    console.setup_logging(verbose=True)
    absl_logging.info("orbax-style chatter")
    assert any("orbax-style chatter" in x for x in absl_stream())


# ----------------------------------------------------------------------------- a real run

@pytest.mark.slow
def test_console_of_a_tiny_run_is_progress_evals_and_a_summary(tmp_path):
    """The whole console of `python -m lrl.main` on a tiny default: every line is lrl's."""
    out = _main("--config=configs/default.py:runlocal", f"--workdir={tmp_path}",
                "--config.model.d_model=32", "--config.model.n_layers=2",
                "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
                "--config.model.head_dim=16", "--config.model.mlp_dim=64",
                "--config.sft.steps=4", "--config.sft.rows=2", "--config.sft.row_len=128",
                "--config.sft.warmup_steps=1", "--config.optim.warmup_steps=1",
                "--config.rl.steps=2",
                "--config.rl.prompts_per_step=2", "--config.rl.group_size=2",
                "--config.rl.max_new_tokens=6", "--config.rl.row_len=128",
                "--config.data.max_prompt_len=96",
                "--config.eval.every=2", "--config.eval.num_prompts=2", "--config.eval.k=2",
                "--config.data.eval_size=2", "--config.metrics.tensorboard=False",
                # XLA's C++ runtime logs everything (as its GPU autotuner's errors on an H200):
                # the lines go to the workdir's xla.log, not the console
                TF_CPP_MIN_LOG_LEVEL="0")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    absl_prefix = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")
    assert not [x for x in lines if absl_prefix.match(x)], "library log lines on the console"
    cpp = (tmp_path / "xla.log").read_text().splitlines()
    assert [x for x in cpp if absl_prefix.match(x)], "no C++ log line was provoked"
    assert f"XLA's C++ log lines in {tmp_path / 'xla.log'}" in lines[4]
    assert lines[5].startswith(f"  cache    {tmp_path.parent / '.lrl-cache'}")
    for bad in ("Traceback", "PyTorch was not found", "Unable to initialize backend",
                "is illegal", "Missing metrics"):
        assert bad not in out.stdout + out.stderr, bad
    assert lines[0].startswith("lrl: job 'grpo'")
    assert sum(x.startswith("sft ") for x in lines) == 4
    grpo = [x for x in lines if x.startswith("grpo ")]
    assert len(grpo) == 3 and "before step 1" in grpo[0] and "held-out reward" in grpo[2]
    done = next(i for i, x in enumerate(lines) if x.startswith("== done in"))
    tail = "\n".join(lines[done:])
    assert "4 SFT steps" in lines[done] and "2 GRPO steps" in lines[done]
    assert "held-out reward" in tail and "metrics.jsonl" in tail and "checkpoints/" in tail
    assert lines[-1].startswith("   export to Hugging Face: python -m lrl.export")
    # banner 6 + 2 phase banners of 2 lines + 4 + 3 progress lines + the summary
    assert len(lines) <= 6 + 4 + 7 + 12, "\n".join(lines)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, 5, 6]
