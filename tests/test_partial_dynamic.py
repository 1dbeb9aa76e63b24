"""Partial rollouts with reinforce_pp: a step training fewer groups than prompts_per_step
whitens over its own samples, as the estimator over those samples alone does, compiles
nothing new for the count, and runs through the real loop on the tiny model."""
import numpy as np

from lrl import compiles, grpo, loop, rl
from lrl.tasks import Prompt
from tests.test_partial import _loop_config, _rows


def _groups(rewards_PG, lengths_PG):
    G = rewards_PG.shape[1]
    return grpo.Groups(tuple(Prompt(np.ones(2, np.int32), "", {}, "") for _ in rewards_PG),
                       tuple(np.ones(n, np.int32) for n in lengths_PG.reshape(-1)),
                       (), G, np.zeros(rewards_PG.size, bool),
                       rewards_PG=np.asarray(rewards_PG, np.float32))


def test_a_partial_steps_reinforce_pp_whitens_over_its_own_samples_with_no_new_compile():
    rng = np.random.default_rng(0)
    for estimator in ("reinforce_pp", "reinforce_pp_token"):
        for P in (1, 2, 3, 5):
            rewards = rng.integers(0, 3, (P, 4)).astype(np.float32)
            rewards[0] = [0, 1, 0, 1]   # at least one informative group
            lengths = rng.integers(1, 30, (P, 4))
            got = grpo.advantages(_groups(rewards, lengths), estimator, pad_P=5)
            want = np.asarray(rl.advantages(rewards, estimator, lengths_PG=lengths))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"P={P}")
            if P < 5 and estimator == "reinforce_pp":   # zero rows alone would not do
                zero = np.pad(rewards, ((0, 5 - P), (0, 0)))
                assert not np.allclose(np.asarray(rl.advantages(zero, estimator))[:P], want)
        # Any count, one shape: nothing compiles again.
        before = compiles.snapshot()
        for P in (4, 1, 3):
            grpo.advantages(_groups(np.tile([[0.0, 1, 1, 0]], (P, 1)), np.ones((P, 4), int)),
                            estimator, pad_P=5)
        assert compiles.since(before) == {}, compiles.since(before)


def test_tiny_loop_runs_partial_rollouts_with_reinforce_pp(tmp_path, monkeypatch):
    c = _loop_config(monkeypatch, steps=5)
    c.rl.estimator = "reinforce_pp"
    seen, real = [], grpo.advantages
    monkeypatch.setattr(grpo, "advantages", lambda groups, *a, **k: seen.append(
        (groups, real(groups, *a, **k))) or seen[-1][1])
    loop.run(c, str(tmp_path))
    steps = [r for r in _rows(tmp_path) if "compiles/step" in r]
    assert len(steps) == 5 and len(seen) == sum(r["partial/trained_groups"] > 0 for r in steps)
    assert any(g.P < c.rl.prompts_per_step for g, _ in seen)
    for groups, adv in seen:
        np.testing.assert_allclose(adv, np.asarray(rl.advantages(groups.rewards_PG,
                                                                 "reinforce_pp")),
                                   rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(r["loss"]) for r in steps if r["partial/trained_groups"])
    assert [r["compiles/step"] for r in steps[2:]] == [0] * 3, [r["compiles/step"] for r in steps]
