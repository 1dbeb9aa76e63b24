"""The experiment end to end: the default config's GRPO loop on tiny settings, resume after
SIGTERM, and the errors a researcher meets first (unknown config keys, missing files)."""
import json
import logging
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from lrl import checkpoint as ckpt_lib
from lrl import checkpoint_space as ckpt_space
from lrl import config_util
from lrl import rewards
from lrl import loop
from lrl import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@rewards.register("test_digits")
def digits_reward(completion: str, answer: str, **meta) -> float:
    """A dense reward an untrained model already varies on, so GRPO steps move the params."""
    return sum(ch.isdigit() for ch in completion) / 10.0


def tiny_config(**rl):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64)
    c.data.task_kwargs.arithmetic.update(num_terms=2, min_terms=2)
    c.data.max_prompt_len = 96
    c.tokenizer.vocab_size = 300
    c.sft.update(steps=3, rows=4, row_len=128, warmup_steps=1)
    c.rl.update(steps=3, prompts_per_step=4, group_size=2, max_new_tokens=6, row_len=128, **rl)
    c.mesh.update(fsdp=4, tensor=2)
    c.eval.update(every=2, num_prompts=4, k=2)
    c.data.eval_size = 4
    c.checkpoint.update(every_steps=1, keep=10)
    c.optim.lr = 1e-3  # large enough that three GRPO steps visibly move a tiny model
    c.metrics.tensorboard = False
    c.reward.num_workers = 0
    return c


def _params(workdir, step=None):
    return ckpt_lib.restore_params(os.path.join(workdir, "checkpoints"), step=step).state


@pytest.mark.slow
def test_grpo_runs_end_to_end_and_writes_what_it_promises(tmp_path, monkeypatch, caplog):
    # A disk too small for the checkpoints is said at start-up (the saves here still work).
    monkeypatch.setattr(ckpt_space, "free_bytes", lambda directory: 1000)
    with caplog.at_level(logging.WARNING, "lrl"):
        out = loop.run(tiny_config(), str(tmp_path))
    assert [r for r in caplog.records
            if r.getMessage().startswith("checkpoints: the next save cannot fit")], caplog.text
    for name in ("metrics.jsonl", "samples.jsonl", "grpo_curves.png", "sft_curves.png"):
        assert (tmp_path / name).exists(), name
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    baseline, *grpo_rows = [r for r in rows if r["phase"] == "grpo"]
    # The held-out eval of the policy as GRPO starts, then one row per GRPO step.
    assert baseline["step"] == 3 and "eval/pass@2" in baseline and "loss" not in baseline
    assert [r["step"] for r in grpo_rows] == [4, 5, 6]
    assert all(np.isfinite(r["loss"]) and "reward/mean" in r for r in grpo_rows)
    assert "eval/pass@2" in grpo_rows[1] and grpo_rows[0]["reward/n_items"] == 8
    assert out["grpo"]["response/length_mean"] > 0
    # The update's first minibatch measured the sampler against the trainer, sharded (fp32
    # both: no mismatch).
    assert all(r["mismatch/tokens"] > 0 and r["mismatch/abs_max"] < 1e-3 for r in grpo_rows)
    assert sorted(ckpt_lib.CheckpointManager(tmp_path / "checkpoints").all_steps())[-1] == 6


@pytest.mark.slow
def test_sigterm_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
    cfg = tiny_config(dynamic_sampling=True, epochs=2)
    cfg.eval.every = 0
    cfg.reward.spec = "test_digits:1.0"
    loop.run(cfg, str(tmp_path / "straight"))
    want = _params(str(tmp_path / "straight"))

    write = metrics_lib.MetricsWriter.write

    def write_then_sigterm(self, step, metrics, phase="grpo"):
        scalars = write(self, step, metrics, phase)
        if step == 4:  # the first GRPO step: the handler only sets a flag, the loop saves
            os.kill(os.getpid(), signal.SIGTERM)
        return scalars

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_sigterm)
    loop.run(cfg, str(tmp_path / "cut"))
    steps = ckpt_lib.CheckpointManager(tmp_path / "cut" / "checkpoints").all_steps()
    assert steps[-1] == 4
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
    loop.run(cfg, str(tmp_path / "cut"))  # resumes at step 5
    got = _params(str(tmp_path / "cut"))
    start = _params(str(tmp_path / "straight"), step=3)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(start)))
    assert moved > 1e-4  # the GRPO steps did change the policy
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def _main(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lrl.main", *args], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_unknown_config_key_fails_with_its_name(tmp_path):
    out = _main("--config=configs/default.py", f"--workdir={tmp_path}",
                "--config.rl.group_sise=16")
    assert out.returncode != 0 and "group_sise" in out.stderr


def test_missing_files_are_named(tmp_path):
    from lrl.data.synthetic import synthetic_corpus
    from lrl.data.tokenizer import build_tokenizer
    build_tokenizer(synthetic_corpus(200), 300, out_dir=str(tmp_path / "tok"))
    common = ["--config=configs/default.py:runlocal", f"--workdir={tmp_path / 'run'}",
              "--config.data.source=jsonl", "--config.sft.steps=0"]
    out = _main(*common, "--config.data.paths=/no/such/train.jsonl",
                f"--config.tokenizer.path={tmp_path / 'tok'}")
    assert out.returncode != 0 and "/no/such/train.jsonl" in out.stderr
    out = _main(*common, f"--config.data.paths={tmp_path / 'tok' / 'tokenizer.json'}",
                "--config.tokenizer.path=/no/such/tokenizer")
    assert out.returncode != 0 and "/no/such/tokenizer" in out.stderr


def test_bad_job_and_bad_source_are_refused(tmp_path):
    cfg = tiny_config()
    cfg.job = "ppo"
    with pytest.raises(ValueError, match="ppo"):
        loop.run(cfg, str(tmp_path))
    cfg = tiny_config()
    cfg.data.source = "csv"
    cfg.tokenizer.path = str(tmp_path / "tok")
    from lrl.data.synthetic import synthetic_corpus
    from lrl.data.tokenizer import build_tokenizer
    build_tokenizer(synthetic_corpus(200), 300, out_dir=str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="csv"):
        loop.run(cfg, str(tmp_path / "run"))
