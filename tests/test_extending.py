"""docs/extending.md's worked example (experiments/plugins/passk.py): the pass@k estimator and
the CISPO loss against hand-computed numbers, and a tiny GRPO run that selects both by path."""
import pytest
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.plugins import passk
from lrl import loop
from lrl.rl import losses
from tests.test_loop import tiny_config

ESTIMATOR = "experiments.plugins.passk:passk_advantages"
LOSS = "experiments.plugins.passk:cispo"


def test_passk_advantages_by_hand():
    # N=4, one correct, k=2: R = 1 - C(3,2)/C(4,2) = 1/2, s = 1/2; A_pos = 1;
    # A_neg = (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3. They sum to 0 over the group.
    # N=4, three correct, k=2: R = 1 - 0 = 1: no signal. Two correct: R = 1 - 1/6 = 5/6,
    # s = sqrt(5/36); A_pos = (1/6)/s = 0.4472136; A_neg = (1/6 - C(1,1)/C(3,1)) / s = -0.4472136.
    r = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0],
                  [1.0, 0.0, 0.0, 0.0]])
    a = passk.passk_advantages(r, mask_P=np.array([True, True, True, False]))
    np.testing.assert_allclose(a[0], [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    np.testing.assert_allclose(a[1], [0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(a[2], [-0.4472136, 0.4472136, 0.4472136, -0.4472136], rtol=1e-6)
    np.testing.assert_array_equal(a[3], 0.0)              # padding row
    # k = 1 is plain GRPO on binary rewards with the population std (ddof 0)
    g = np.array([[1.0, 0.0, 0.0, 1.0, 1.0]])
    np.testing.assert_allclose(passk.pass_at_k_advantages(g, 1)[0],
                               (g[0] - g.mean()) / g.std(), rtol=1e-6)


def test_cispo_by_hand():
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    old = jnp.array([[-1.5, -2.0, -0.4]])   # ratios e^.5 = 1.6487 (clipped to 1.28), 1, e^-.1
    adv = jnp.array([[1.0, -2.0, 0.5]])
    cfg = losses.LossConfig(clip_low=0.2, clip_high=0.28)
    term, m = passk.cispo(logp, old, adv, jnp.ones_like(logp, bool), cfg)
    w = np.array([1.28, 1.0, np.exp(-0.1)])
    np.testing.assert_allclose(term[0], -w * np.array([1.0, -2.0, 0.5]) * np.array(
        [-1.0, -2.0, -0.5]), rtol=1e-6)
    np.testing.assert_array_equal(m["cispo_clipped_frac"][0], [1.0, 0.0, 0.0])
    # every token keeps a gradient, -w A, even the clipped one
    g = jax.grad(lambda x: passk.cispo(x, old, adv, None, cfg)[0].sum())(logp)
    np.testing.assert_allclose(g[0], -w * np.array([1.0, -2.0, 0.5]), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.optimized
def test_tiny_grpo_run_with_the_plugins(tmp_path, monkeypatch):
    calls, real = [], passk.passk_advantages

    @functools.wraps(real)
    def spy(rewards_PG, *, mask_P=None):
        calls.append(np.asarray(rewards_PG).shape)
        return real(rewards_PG, mask_P=mask_P)

    monkeypatch.setattr(passk, "passk_advantages", spy)   # what the registry imports
    cfg = tiny_config(estimator=ESTIMATOR)
    cfg.rl.loss.policy_loss = LOSS
    cfg.rl.steps = 2
    cfg.eval.every = 0
    loop.run(cfg, str(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "grpo" and "loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    assert calls == [(4, 2), (4, 2)]                     # the plugin gave each step's advantages
    assert all("policy_loss/cispo_clipped_frac" in r for r in steps)
