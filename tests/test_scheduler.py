"""The scheduler (`lrl.rollout.scheduler`) pinned to the schedule it replaced: a seeded sampled
rollout in a pool small enough to preempt, and a partial rollout stopped early, give the
tokens, log-probs and schedule (calls, steps, preemptions, pages) that the pre-refactor
`generate` gave; and the public `generate`'s keywords go where they belong."""
import jax
import numpy as np
import pytest

import lrl.models as models
import lrl.rollout as rollout
from lrl.rollout import scheduler

CFG = models.ModelConfig(model_type="qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=8, mlp_dim=64, remat="none")
KW = dict(max_new_tokens=24, num_samples=3, temperature=1.0, seed=5, max_slots=6, page_size=4,
          prefill_chunk=8, pool_tokens=4 * 22, eos_ids=(7,), steps_per_call=4)

# Recorded from the pre-refactor scheduler (`generate`'s closures) at commit 29e2cbe, with
# KW above: the same tokens with and without overlap_admission (keys per sample and step).
PREEMPTED = [
    [
        [38, 6, 8, 25, 57, 59, 13, 11, 57, 60, 21, 10, 34, 52, 40, 5, 51, 12, 40, 62, 18, 0, 57,
         50],
        [57, 35, 31, 43, 47, 25, 42, 43, 31, 24, 19, 24, 45, 38, 37, 12, 22, 33, 24, 59, 46, 50,
         11, 9],
        [2, 6, 7],
    ],
    [
        [27, 8, 57, 54, 59, 41, 52, 2, 22, 62, 38, 11, 36, 43, 33, 49, 23, 40, 45, 23, 39, 8, 12,
         4],
        [34, 36, 55, 48, 42, 38, 34, 14, 35, 20, 23, 8, 28, 23, 34, 25, 27, 59, 41, 16, 29, 62,
         25, 4],
        [36, 20, 21, 59, 48, 44, 33, 61, 39, 39, 36, 52, 44, 55, 8, 59, 44, 19, 36, 9, 4, 1, 28,
         29],
    ],
    [
        [57, 63, 53, 48, 2, 9, 12, 60, 34, 61, 7],
        [48, 63, 18, 48, 59, 6, 19, 27, 62, 47, 18, 61, 22, 13, 51, 24, 27, 47, 15, 33, 27, 26,
         3, 29],
        [45, 13, 22, 13, 13, 21, 22, 15, 29, 17, 50, 29, 47, 45, 39, 0, 24, 6, 32, 63, 44, 25,
         48, 37],
    ],
    [
        [20, 24, 50, 63, 44, 44, 38, 11, 54, 51, 37, 9, 38, 20, 23, 6, 58, 6, 24, 23, 29, 49, 14,
         42],
        [48, 19, 43, 5, 31, 13, 8, 20, 0, 8, 53, 46, 1, 36, 14, 37, 42, 39, 42, 60, 58, 13, 48, 1],
        [52, 10, 30, 44, 42, 23, 57, 21, 20, 14, 5, 4, 42, 57, 39, 47, 52, 37, 37, 33, 44, 37,
         39, 16],
    ],
]
SCHEDULE = {
    "at_once": dict(preempted=9, preempted_tokens=120, decode_calls=31, decode_steps=120,
                    sampled_tokens=374, peak_pages=22, pages_allocated=127),
    "overlap": dict(preempted=8, preempted_tokens=100, decode_calls=28, decode_steps=100,
                    sampled_tokens=354, peak_pages=22, pages_allocated=121),
}
FIRST_LOGP = -4.423574447631836   # sample (0, 0)'s first token's log-prob
# The same, stopped once 70 tokens were sampled, samples forced to LENGTHS (`max_new_fn`).
LENGTHS = [5, 24, 2, 9, 24, 1, 24, 24, 3, 24, 7, 24]
# Each sample's tokens: the first STOPPED[p][g] of PREEMPTED[p][g] (the draws are the same).
STOPPED = [[5, 20, 2], [9, 20, 1], [11, 4, 3], [0, 0, 0]]
UNFINISHED = ((0, 1), (1, 1), (2, 1), (3, 0), (3, 1), (3, 2))


@pytest.fixture(scope="module")
def setup():
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                          models.init_params(CFG, jax.random.key(0)))
    rng = np.random.RandomState(0)
    return params, [rng.randint(1, 64, n).astype(np.int32) for n in (7, 3, 10, 6)]


@pytest.mark.parametrize("mode", ["at_once", "overlap"])
def test_a_preempting_rollout_keeps_the_old_tokens_and_schedule(setup, mode):
    params, prompts = setup
    stats = {}
    outs = rollout.generate(CFG, params, prompts, stats=stats,
                            overlap_admission=mode == "overlap", **KW)
    assert [[t.tolist() for t, _ in per] for per in outs] == PREEMPTED
    assert {k: stats[k] for k in SCHEDULE[mode]} == SCHEDULE[mode]
    np.testing.assert_allclose(outs[0][0][1][0], FIRST_LOGP, rtol=1e-5)
    assert stats["new_tokens"] == sum(len(t) for per in PREEMPTED for t in per)


def test_a_stopped_rollout_keeps_the_old_tokens_through_the_request(setup):
    """The partial rollout's arguments in one `Request`, run on an engine by
    `scheduler.run`: live samples return their tokens so far, waiting ones none."""
    params, prompts = setup
    request = rollout.Request(prompts, 24, 3, seed=5, sampling=rollout.SamplingParams(1.0),
                              eos_ids=(7,), stop_fn=lambda done, n: n >= 70,
                              max_new_fn=LENGTHS.__getitem__)
    engine = rollout.engine_for(CFG, request, max_slots=6, page_size=4, prefill_chunk=8,
                                pool_tokens=4 * 22)
    stats = {}
    result = scheduler.run(engine, params, request, stats=stats,
                           policy=rollout.Policy(steps_per_call=4))
    assert [[t.tolist() for t, _ in per] for per in result.samples] == [
        [t[:n] for t, n in zip(per, lengths)] for per, lengths in zip(PREEMPTED, STOPPED)]
    assert result.unfinished == UNFINISHED and result.kept == {}
    assert (stats["decode_calls"], stats["sampled_tokens"]) == (5, 75)
    assert engine.pool.all_free() and all(s is None for s in engine.slot_pages)


def test_generate_sends_each_keyword_to_its_owner(setup):
    params, prompts = setup
    engine = rollout.engine_for(CFG, rollout.Request(prompts, 4), page_size=4)
    with pytest.raises(ValueError, match=r"\['page_size'\] size an engine built for the call"):
        rollout.generate(CFG, params, prompts, max_new_tokens=4, engine=engine, page_size=8)
    with pytest.raises(TypeError, match="no_such_option"):
        rollout.generate(CFG, params, prompts, max_new_tokens=4, no_such_option=1)
    with pytest.raises(ValueError, match="max_new_per_prompt"):
        rollout.generate(CFG, params, prompts, max_new_tokens=4, max_new_per_prompt=[5] * 4)
    outs = rollout.generate(CFG, params, prompts, max_new_tokens=4, engine=engine,
                            steps_per_call=2, max_new_per_prompt=[1, 2, 3, 4])
    assert [len(per[0][0]) for per in outs] == [1, 2, 3, 4]
