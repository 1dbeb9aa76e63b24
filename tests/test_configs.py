"""Every config file builds, passes the up-front checks, and has its command in its docstring;
bad values fail at start-up naming their key; configs import nothing that pulls in jax."""
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

from lrl import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
ARGS = {"qwen2_5_math.py": ["1.5b", "7b"], "default.py": [None, "runlocal", "ppo"],
        "ppo_math.py": [None, "lam95"],
        "long_context_ring.py": [None, "runlocal"], "video_qa.py": [None, "runlocal"],
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
        # Real-model configs need their paths: give them, then the checks must pass.
        if c.data.source != "synthetic":
            c.data.paths = "/data/train.jsonl"
        build.options(c, check_files=False)
    with pytest.raises(ValueError):
        mod.get_config("no-such-variant")


@pytest.mark.parametrize("key,value,match", [
    ("rl.logprob_chunk", 0, r"rl.logprob_chunk=0: must be >= 1"),
    ("rl.group_size", 1, "rl.group_size=1"),
    ("rl.minibatches", 0, r"rl.minibatches=0: must be >= 1"),
    ("rl.top_p", 0.0, r"rl.top_p=0.0: must be > 0"),
    ("optim.lr", 0.0, r"optim.lr=0.0: must be > 0"),
    ("rollout.page_size", 0, "rollout.page_size=0"),
    ("eval.k", 0, "eval.k=0"),
    ("checkpoint.keep", 0, "checkpoint.keep=0"),
    ("rl.overlong", "clip", "rl.overlong='clip'"),
    ("rl.shared_prompt", "yes", r"rl.shared_prompt='yes'; choose one of \('off', 'on', 'auto'\)"),
    ("model.dtype", "fp8", "model.dtype='fp8'"),
    ("model.param_shard_axes", "fsdp,tensor", "model.param_shard_axes='fsdp,tensor'"),
])
def test_bad_values_fail_up_front_naming_the_key(key, value, match):
    c = _load(os.path.join(ROOT, "configs", "default.py")).get_config()
    *sections, name = key.split(".")
    node = c
    for sec in sections:
        node = node[sec]
    node[name] = value
    with pytest.raises(ValueError, match=match):
        build.options(c)


def test_cross_field_rules_and_missing_files_are_named(tmp_path):
    default = os.path.join(ROOT, "configs", "default.py")
    c = _load(default).get_config()
    c.rl.loss.dual_clip = 0.5
    with pytest.raises(ValueError, match="rl.loss.dual_clip=0.5"):
        build.options(c)
    c = _load(default).get_config()
    c.data.update(source="jsonl", paths=str(tmp_path / "train.jsonl"))
    c.tokenizer.path = str(tmp_path)
    c.sft.steps = 0
    with pytest.raises(FileNotFoundError, match="data.paths.*train.jsonl"):
        build.options(c)
    (tmp_path / "train.jsonl").write_text("{}\n")
    c.data.eval_paths = str(tmp_path / "held_out.jsonl")   # read only after the warm start
    with pytest.raises(FileNotFoundError, match="data.eval_paths.*held_out.jsonl"):
        build.options(c)
    c.data.eval_paths = ""
    c.model.hf_path = str(tmp_path / "no-model")
    with pytest.raises(FileNotFoundError, match="model.hf_path"):
        build.options(c)
    c = _load(default).get_config()
    c.job = "grpo_video"
    with pytest.raises(ValueError, match="task='video'"):
        build.options(c)


def test_video_configs_pass_their_checks_and_name_bad_values():
    c = _load(os.path.join(ROOT, "configs", "video_synthetic.py")).get_config()
    opts = build.options(c)
    assert opts.task == "video" and opts.video.num_frames == 4
    # One schema: the video task has every field of the text job's rl section.
    assert opts.rl.recompute_old_logp is False and opts.rl.dynamic_sampling is False
    c.rl.logprob_chunk = -1
    with pytest.raises(ValueError, match="rl.logprob_chunk=-1"):
        build.options(c)
    c = _load(os.path.join(ROOT, "configs", "default.py")).get_config()
    c.task = "video"
    with pytest.raises(ValueError, match="'video'"):
        build.options(c)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_a_config_builds_without_jax(path):
    """A config imports nothing from lrl but its config helper: it can be read and linted
    where only ml_collections is installed."""
    code = ("import sys, importlib.util; sys.path.insert(0, %r)\n"
            "spec = importlib.util.spec_from_file_location('c', %r)\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "m.get_config()\n"
            "bad = [k for k in sys.modules if k == 'jax' or k.startswith(('jax.', 'flax'))]\n"
            "assert not bad, bad\n") % (ROOT, path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
