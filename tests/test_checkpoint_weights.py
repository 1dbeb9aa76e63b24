"""checkpoint.contents="weights": the master weights without the optimizer's state, for disks
that cannot take an Adam state (a 7B run with fp32 masters: ~100 GiB a save, ~28 GiB weights)."""
import json
import logging

import jax
import numpy as np
import pytest

from lrl import checkpoint as ck


def _meta(step_dir):
    return json.loads((step_dir / "meta" / "metadata").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["off", "on"])
def test_weights_only_saves_what_a_full_run_learns_exports_and_resumes(tmp_path, caplog,
                                                                       offload):
    """The same run saved both ways holds the same weights (offloaded: the host's fp32
    masters); the weights-only steps keep no optimizer leaf; a longer run on
    them resumes with its optimizer started again, and says so."""
    from lrl import export, loop
    from tests.test_loop import tiny_config

    def cfg(contents, steps=2):
        c = tiny_config()
        c.sft.steps, c.rl.steps, c.eval.every = 2, steps, 0
        c.optim.offload = offload
        c.checkpoint.contents = contents
        return c

    loop.run(cfg("full"), str(tmp_path / "full"))
    loop.run(cfg("weights"), str(tmp_path / "weights"))
    full, light = tmp_path / "full" / "checkpoints", tmp_path / "weights" / "checkpoints"
    want = ck.restore_params(str(full)).state
    got = ck.restore_params(str(light))
    assert got.step == 4
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(want), strict=True):
        assert a.dtype == np.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    for step in (2, 4):    # an SFT step and a GRPO step
        assert _meta(light / str(step))["contents"] == "weights"
        assert _meta(full / str(step))["contents"] == "full"
        sums = _meta(light / str(step))["checksums"]
        assert sums and not [k for k in sums if "opt_state" in k], sorted(sums)
        assert any("opt_state" in k for k in _meta(full / str(step))["checksums"])
    export.export(str(light), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").exists()

    with caplog.at_level(logging.WARNING, "lrl"):
        out = loop.run(cfg("weights", steps=3), str(tmp_path / "weights"))   # GRPO step 3
    assert "holds the weights only" in caplog.text and "step 4" in caplog.text
    assert np.isfinite(out["grpo"]["loss"])
    steps = [json.loads(x)["step"] for x in (tmp_path / "weights" / "metrics.jsonl")
             .read_text().splitlines()]
    assert steps[-1] == 5 and steps.count(5) == 1
    assert ck.restore_params(str(light)).step == 5


@pytest.mark.slow
def test_ppo_saves_the_critics_weights_only_and_resumes_with_both_optimizers_fresh(
        tmp_path, caplog):
    from lrl import loop
    from tests.test_critic import _ppo_config

    cfg = _ppo_config()
    cfg.rl.steps = 2
    cfg.checkpoint.contents = "weights"
    loop.run(cfg, str(tmp_path))
    meta = _meta(tmp_path / "checkpoints" / "5")    # 3 SFT steps, then 2 PPO steps
    assert meta["contents"] == "weights" and {"critic", "reference"} <= set(meta["items"])
    for sums in (meta["checksums"], meta["tree_checksums"]["critic"]):
        assert sums and not [k for k in sums if "opt_state" in k], sorted(sums)
    cfg.rl.steps = 3
    with caplog.at_level(logging.WARNING, "lrl"):
        out = loop.run(cfg, str(tmp_path))
    assert "holds the weights only" in caplog.text and "step 5" in caplog.text
    assert np.isfinite(out["grpo"]["critic/vf_loss"]) and np.isfinite(out["grpo"]["loss"])
    assert _meta(tmp_path / "checkpoints" / "6")["contents"] == "weights"
