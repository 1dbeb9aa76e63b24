"""The host step's pieces return new values (nothing mutates its inputs); text prompts above
`rollout.sp_min_tokens` take the sequence-parallel prefill on a seq > 1 mesh and sample what
the engine's own prefill samples; the long-context ring config runs through the one loop."""
import dataclasses
import os

import jax
import numpy as np
import pytest

from lrl import config_util, grpo, loop, models, options
from lrl import mesh as mesh_lib
from lrl.rewards import register
from lrl.rollout import sp_prefill
from lrl.tasks import Prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rl(**kw):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.rl.update(**kw)
    return options.from_config(c).rl


def _groups(rewards_PG, lengths, max_new=8):
    P, G = rewards_PG.shape
    prompts = tuple(Prompt(np.arange(1, 4, dtype=np.int32), str(p), {}, "") for p in range(P))
    comps = tuple(np.full(n, 7, np.int32) for n in lengths)
    return grpo.Groups(prompts, comps, tuple(np.zeros(n, np.float32) for n in lengths), G,
                       np.array([n >= max_new for n in lengths]),
                       texts=tuple("x" * n for n in lengths), rewards_PG=rewards_PG)


def test_shaping_and_selection_return_new_groups():
    rewards = np.array([[1.0, 0.0], [0.5, 0.5]], np.float32)
    g = _groups(rewards.copy(), [8, 3, 8, 5])
    rl = _rl(overlong="penalty", overlong_buffer=4, overlong_penalty=1.0, max_new_tokens=8)
    shaped, weight = grpo.shape_overlong(g, rl)
    np.testing.assert_array_equal(g.rewards_PG, rewards)          # the input is untouched
    # ramp (length - (8 - 4)) / 4: lengths 8, 3, 8, 5 lose 1, 0, 1 and 0.25
    np.testing.assert_allclose(shaped.rewards_PG, [[0.0, 0.0], [-0.5, 0.25]])
    assert weight.tolist() == [1, 1, 1, 1]
    _, weight = grpo.shape_overlong(g, dataclasses.replace(rl, overlong="mask"))
    assert weight.tolist() == [0, 1, 0, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.rewards_PG = None
    kept = g.take(grpo.informative(g.rewards_PG))
    assert kept.P == 1 and kept.prompts[0].answer == "0" and len(kept.completions) == 2
    both = grpo.Groups.concat([kept, g.take(np.array([False, True]))])
    assert [p.answer for p in both.prompts] == ["0", "1"] and both.rewards_PG.shape == (2, 2)
    assert both.texts == ("x" * 8, "xxx", "x" * 8, "xxxxx")


def test_old_log_probs_come_from_one_rule():
    assert _rl().old_logp == "sampler"                       # plain temperature-1 sampling
    assert _rl(temperature=0.7, minibatches=1).old_logp == "none"
    assert _rl(temperature=0.7, minibatches=2).old_logp == "trainer"
    assert _rl(recompute_old_logp=True, epochs=2, minibatches=1).old_logp == "trainer"


def test_text_prompts_above_sp_min_tokens_prefill_over_seq(monkeypatch):
    cfg = models.ModelConfig(model_type="qwen2", vocab_size=128, d_model=32, n_layers=2,
                             n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True,
                             remat="none", attention="ring")
    mesh = mesh_lib.make_mesh({"fsdp": 4, "seq": 2})
    params = models.init_params(cfg, jax.random.key(0), mesh)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 3 else x, params)  # varied samples
    rng = np.random.RandomState(0)
    prompts = [Prompt(rng.randint(1, 120, n).astype(np.int32), "", {}, "") for n in (20, 61, 90)]
    rl = _rl(max_new_tokens=6, temperature=0.0)
    ro = options.RolloutOptions(page_size=8, max_slots=4, pool_tokens=0, pool_fraction=0.4,
                                prefill_tokens=1024, sp_min_tokens=48)
    setup = grpo.Setup(rl=rl, rollout=ro, seed=0, task=None, tokenizer=None, model_cfg=cfg,
                       mesh=mesh, eos_ids=(), pool=None, update=None, logprobs=None, shards=4,
                       row_len=128, rows_per_shard=1, max_segments=64)
    sharded_lengths = []
    call = sp_prefill._call

    def recording(engine, cfg_, params_, mesh_, kp, vp, group, rows, T):
        sharded_lengths.extend(p.cached for p in group)
        return call(engine, cfg_, params_, mesh_, kp, vp, group, rows, T)

    monkeypatch.setattr(sp_prefill, "_call", recording)
    want = grpo.rollout_groups(setup, params, prompts, group_size=2, seed=0)
    sp = dataclasses.replace(setup, prefill=sp_prefill.make_prefill(mesh, ro.sp_min_tokens))
    got = grpo.rollout_groups(sp, params, prompts, group_size=2, seed=0)
    assert sorted(sharded_lengths) == [60, 89]   # the two prompts of >= 48 cached tokens
    for w, g, wl, gl in zip(want.completions, got.completions, want.logps, got.logps):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(gl, wl, atol=1e-5)
    assert len({tuple(c) for c in want.completions}) > 1


@register("test_distinct_chars")
def _distinct_chars(completion, answer, **meta):
    """Varies between a random policy's samples, so the update has a gradient."""
    return float(len(set(completion)) % 3)


def test_long_context_ring_runlocal_runs_through_the_one_loop(tmp_path, monkeypatch):
    c = config_util.load(os.path.join(ROOT, "configs", "long_context_ring.py"), "runlocal")
    c.reward.spec = "test_distinct_chars:1.0"
    calls = []
    call = sp_prefill._call
    monkeypatch.setattr(sp_prefill, "_call",
                        lambda *a: calls.append(a[-1]) or call(*a))
    m = loop.run(c, str(tmp_path))["grpo"]
    assert m["rollout/sp_prefill"] == 1 and calls     # long prompts took the seq prefill
    assert all(T % 4 == 0 for T in calls)              # padded to the ring's 2 x seq chunks
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0 and "eval/pass@2" in m
    # Sampler log-probs (ring-prefilled, engine-decoded) are the ring-sharded trainer's.
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4
