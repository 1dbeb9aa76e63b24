"""Every config file builds, passes the up-front checks, and has its command in its docstring."""
import glob
import importlib.util
import os

import pytest

from lrl import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
ARGS = {"qwen2_5_math.py": ["1.5b", "7b"], "default.py": [None, "runlocal"],
        "video_synthetic.py": [None, "runlocal"]}


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_builds_and_documents_its_command(path):
    mod = _load(path)
    assert "python -m lrl.main --config=configs/" + os.path.basename(path) in mod.__doc__
    for arg in ARGS.get(os.path.basename(path), [None]):
        c = mod.get_config(arg) if arg else mod.get_config()
        if c.job == "grpo_video":  # lrl.vl_grpo checks its own config when it starts
            continue
        # Real-model configs need their paths: give them, then the checks must pass.
        if c.data.source != "synthetic":
            c.data.paths = "/data/train.jsonl"
        experiment.check_config(c)
    with pytest.raises(ValueError):
        mod.get_config("no-such-variant")


@pytest.mark.parametrize("key,value,match", [
    ("rl.logprob_chunk", 0, "rl.logprob_chunk=0"),
    ("rl.group_size", 1, "rl.group_size=1"),
    ("rl.overlong", "clip", "rl.overlong='clip'"),
    ("model.dtype", "fp8", "model.dtype='fp8'"),
    ("model.param_shard_axes", "fsdp,tensor", "model.param_shard_axes='fsdp,tensor'"),
])
def test_bad_values_fail_up_front_naming_the_key(key, value, match):
    c = _load(os.path.join(ROOT, "configs", "default.py")).get_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ValueError, match=match):
        experiment.check_config(c)


def test_video_configs_pass_their_checks_and_name_bad_values():
    from lrl import vl_grpo
    c = _load(os.path.join(ROOT, "configs", "video_synthetic.py")).get_config()
    vl_grpo.check_config(c)
    c.rl.logprob_chunk = -1
    with pytest.raises(ValueError, match="rl.logprob_chunk=-1"):
        vl_grpo.check_config(c)
