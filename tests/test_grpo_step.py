"""The host step's pieces return new values (nothing mutates its inputs); text prompts above
`rollout.sp_min_tokens` take the sequence-parallel prefill on a seq > 1 mesh and sample what
the engine's own prefill samples; the long-context ring config runs through the one loop."""
import dataclasses
import os

import jax
import numpy as np
import pytest

from lrl import collect, config_util, grpo, loop, models, options, step_setup
from lrl import mesh as mesh_lib
from lrl.rewards import register
from lrl.rollout import sp_prefill
from lrl.groups import Groups
from lrl.tasks import Prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rl(loss=None, **kw):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.rl.update(**kw)
    c.rl.loss.update(**(loss or {}))
    return options.from_config(c).rl


def _groups(rewards_PG, lengths, max_new=8):
    P, G = rewards_PG.shape
    prompts = tuple(Prompt(np.arange(1, 4, dtype=np.int32), str(p), {}, "") for p in range(P))
    comps = tuple(np.full(n, 7, np.int32) for n in lengths)
    return Groups(prompts, comps, tuple(np.zeros(n, np.float32) for n in lengths), G,
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
    kept = g.take(collect.informative(g.rewards_PG))
    assert kept.P == 1 and kept.prompts[0].answer == "0" and len(kept.completions) == 2
    both = Groups.concat([kept, g.take(np.array([False, True]))])
    assert [p.answer for p in both.prompts] == ["0", "1"] and both.rewards_PG.shape == (2, 2)
    assert both.texts == ("x" * 8, "xxx", "x" * 8, "xxxxx")


def test_old_log_probs_come_from_one_rule():
    assert _rl().old_logp == "sampler"                       # plain temperature-1 sampling
    assert _rl(temperature=0.7, minibatches=1).old_logp == "none"
    assert _rl(temperature=0.7, minibatches=2).old_logp == "trainer"
    assert _rl(recompute_old_logp=True, epochs=2, minibatches=1).old_logp == "trainer"
    # A rollout correction weighs the trainer's old log-probs against the sampler's.
    assert _rl(loss=dict(tis_cap=2.0)).old_logp == "trainer"
    assert _rl(loss=dict(mask_level="geometric"), temperature=0.7,
               minibatches=1).old_logp == "trainer"
    assert _rl(loss=dict(staleness_decay=0.5)).old_logp == "sampler"
    with pytest.raises(ValueError, match="rl.loss.tis_level='sequence'.*rl.loss.tis_cap"):
        _rl(loss=dict(tis_level="sequence"))
    with pytest.raises(ValueError, match=r"rl.loss.mask_low=1.5: must be <= 1"):
        _rl(loss=dict(mask_low=1.5))
    with pytest.raises(ValueError, match=r"rl.mismatch_fraction=2.0: must be <= 1"):
        _rl(mismatch_fraction=2)


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
                                prefill_tokens=1024, sp_min_tokens=48, narrow_decode=True,
                                overlap_admission=True, partial_backlog=0.0,
                                partial=False,
                                partial_tokens=0, partial_tail=0.0, partial_seconds=0.0,
                                max_staleness=2,
                                partial_keep_kv=True)
    setup = step_setup.Setup(rl=rl, rollout=ro, seed=0, task=None, tokenizer=None, model_cfg=cfg,
                          mesh=mesh, eos_ids=(), pool=None, update=None, logprobs=None, shards=4,
                          row_len=128, rows_per_shard=1, max_segments=64)
    sharded_lengths = []
    call = sp_prefill._call

    def recording(engine, cfg_, params_, mesh_, kp, vp, group, rows, T):
        sharded_lengths.extend(p.cached for p in group)
        return call(engine, cfg_, params_, mesh_, kp, vp, group, rows, T)

    monkeypatch.setattr(sp_prefill, "_call", recording)
    want = collect.rollout_groups(setup, params, prompts, group_size=2, seed=0)
    sp = dataclasses.replace(setup, prefill=sp_prefill.make_prefill(mesh, ro.sp_min_tokens))
    got = collect.rollout_groups(sp, params, prompts, group_size=2, seed=0)
    assert sorted(sharded_lengths) == [60, 89]   # the two prompts of >= 48 cached tokens
    for w, g, wl, gl in zip(want.completions, got.completions, want.logps, got.logps):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(gl, wl, atol=1e-5)
    assert len({tuple(c) for c in want.completions}) > 1


@register("test_distinct_chars")
def _distinct_chars(completion, answer, **meta):
    """Varies between a random policy's samples, so the update has a gradient."""
    return float(len(set(completion)) % 3)


@pytest.mark.slow
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
    assert m["pack/shared_frac"] == 1     # the config's shared prompt, over the ring
    # Sampler log-probs (ring-prefilled, engine-decoded) are the ring-sharded trainer's.
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4


class _TextRows:
    """The text task's part of `pack`: rows as packed, no forward extra."""
    def update_inputs(self, rows, layout, sample_prompts):
        return rows, None


TINY = models.ModelConfig(model_type="qwen2", vocab_size=64, d_model=32, n_layers=2,
                          n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, remat="none")


def _mismatch_setup(rows_per_shard=1, **rl_kw):
    from lrl.rl import update as upd
    rl = _rl(max_new_tokens=8, **rl_kw)
    ro = options.RolloutOptions(page_size=4, max_slots=8, pool_tokens=0, pool_fraction=0.4,
                                prefill_tokens=256, sp_min_tokens=0, narrow_decode=True,
                                overlap_admission=True, partial_backlog=0.0,
                                partial=False,
                                partial_tokens=0, partial_tail=0.0, partial_seconds=0.0,
                                max_staleness=2,
                                partial_keep_kv=True)
    return step_setup.Setup(rl=rl, rollout=ro, seed=5, task=_TextRows(), tokenizer=None,
                         model_cfg=TINY, mesh=None, eos_ids=(), pool=None, update=None,
                         logprobs=upd.make_logprobs_fn(TINY, chunk=16), shards=1, row_len=32,
                         rows_per_shard=rows_per_shard, max_segments=8)


def _update_programs(lr=1.0):
    import optax
    from lrl.rl import LossConfig
    from lrl.rl import update as upd
    return upd.make_update_programs(TINY, LossConfig(), optax.sgd(lr), chunk=16), optax.sgd(lr)


@pytest.mark.slow
def test_the_update_forward_measures_the_mismatch_of_its_first_minibatch_for_free():
    """Without a trainer forward for the old log-probs, the update's first minibatch (the one
    under the weights that sampled) compares its own log-probs with the sampler's, carried in
    its rows: the numbers a forward pass of their own gives, no log-prob program run, and the
    loss, metrics and new params those of the update without them."""
    from lrl.rl import update as upd
    u, tx = _update_programs()
    s = dataclasses.replace(_mismatch_setup(rows_per_shard=2, mismatch_fraction=1.0,
                                            minibatches=1), update=u)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                          models.init_params(TINY, jax.random.key(1)))
    rng = np.random.RandomState(0)
    prompts = [Prompt(rng.randint(1, 64, n).astype(np.int32), "", {}, "") for n in (15, 4, 16, 5)]
    groups = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    adv, weight = np.ones((4, 2), np.float32), np.ones(8, np.float32)
    batches, _ = grpo.minibatches(s, groups, adv, weight)
    n_micro = sum(len(b.micro) for b in batches)
    assert len(batches) == 1 and n_micro >= 2
    # Plain sampling: the sampler's log-probs are the old ones, carried once, and no separate
    # pass measures anything.
    assert s.rl.old_logp == "sampler" and s.rl.update_measures_mismatch
    assert "rollout_logp" not in batches[0].micro[0]
    assert {"old_logp", "response_pos"} <= set(grpo.loss_inputs(s, batches)[0].micro[0])
    assert grpo.mismatch_metrics(s, batches) == {}
    host = jax.tree.map(np.asarray, params)

    def state():   # the update donates it
        return upd.init_train_state(jax.tree.map(jax.numpy.array, host), tx)

    # The engine's fp32 log-probs are the trainer's: no mismatch, over every response token.
    _, m = grpo.updates(s, state(), batches)
    assert m["mismatch/micro_batches"] == n_micro and m["mismatch/tokens"] == 8 * 8
    assert m["mismatch/abs_max"] < 1e-4
    # Sampler log-probs 0.5 below the trainer's: |Δ| = 0.5, k1 = -0.5, k3 = e^.5 - 1.5, no
    # ratio outside [0.5, 2]; 1.0 below: every ratio e > 2 is outside.
    plain = dataclasses.replace(s, rl=dataclasses.replace(s.rl, mismatch_fraction=0.0))
    for shift, outside in ((0.5, 0.0), (1.0, 1.0)):
        low = dataclasses.replace(groups, logps=tuple(lp - shift for lp in groups.logps))
        new, m = grpo.updates(s, state(), grpo.minibatches(s, low, adv, weight)[0])
        np.testing.assert_allclose([m["mismatch/abs_mean"], m["mismatch/k1"],
                                    m["mismatch/k3"], m["mismatch/outside_frac"]],
                                   [shift, -shift, np.expm1(shift) - shift, outside],
                                   rtol=1e-4)
        assert m["mismatch/pos_0_256/tokens"] == 64 and "mismatch/pos_256_1k/abs_mean" not in m
        # The same update without the metrics' arrays: equal loss, metrics and params.
        rows = grpo.minibatches(plain, low, adv, weight)[0]
        assert "response_pos" not in grpo.loss_inputs(plain, rows)[0].micro[0]
        ref, mr = grpo.updates(plain, state(), grpo.loss_inputs(plain, rows))
        assert not any(k.startswith("mismatch/") for k in mr)
        for k in mr:
            np.testing.assert_allclose(m[k], mr[k], rtol=1e-6, err_msg=k)
        for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # A quarter of the micro-batches (rounded up), spread over the first minibatch: a part of
    # the tokens.
    quarter = dataclasses.replace(s, rl=dataclasses.replace(s.rl, mismatch_fraction=0.25))
    rows = grpo.minibatches(quarter, groups, adv, weight)[0]
    assert rows[0].measured == -(-n_micro // 4)
    _, m = grpo.updates(quarter, state(), rows)
    assert m["mismatch/micro_batches"] == rows[0].measured and 0 < m["mismatch/tokens"] < 64
    # Two minibatches: only the first runs under the sampling weights, and it alone measures.
    two = dataclasses.replace(s, rl=_rl(max_new_tokens=8, minibatches=2, mismatch_fraction=1.0))
    assert two.rl.old_logp == "sampler"
    rows = grpo.minibatches(two, groups, adv, weight)[0]
    assert rows[0].measured == len(rows[0].micro) and rows[1].measured == 0
    assert not any(np.asarray(mb["response_pos"]).any() for mb in rows[1].micro)
    _, m = grpo.updates(two, state(), rows)
    first = sum(int((np.asarray(mb["response_pos"]) > 0).sum()) for mb in rows[0].micro)
    assert m["mismatch/micro_batches"] == len(rows[0].micro) and m["mismatch/tokens"] == first
    # Old log-probs from a trainer forward: that pass measures every micro-batch instead, and
    # the update's inputs lose the metrics' arrays.
    trainer = dataclasses.replace(s, rl=_rl(max_new_tokens=8, recompute_old_logp=True,
                                            minibatches=2, mismatch_fraction=1.0))
    rows = grpo.minibatches(trainer, groups, adv, weight)[0]
    assert trainer.rl.old_logp == "trainer" and not trainer.rl.update_measures_mismatch
    assert "rollout_logp" in rows[0].micro[0]
    assert not {"rollout_logp", "response_pos"} & set(grpo.loss_inputs(trainer, rows)[0].micro[0])
    assert grpo.mismatch_metrics(plain, batches) == {}


def test_warm_up_compiles_the_shapes_not_run_yet_and_changes_nothing():
    """The first step's rows need [2, 32] and [1, 32]; `warm_up` runs the one shape more a
    run may take, [1, 16], through the log-prob, mismatch and update programs, on empty
    rows and without an optimizer step; once every shape has run it does nothing."""
    import optax
    from lrl import compiles
    from lrl.rl import LossConfig
    from lrl.rl import update as upd
    s = _mismatch_setup(rows_per_shard=2, recompute_old_logp=True, minibatches=2)
    u = upd.make_update_programs(TINY, LossConfig(), optax.sgd(1.0), chunk=16)
    s = dataclasses.replace(s, update=u, buckets=(16,))
    params = models.init_params(TINY, jax.random.key(1))
    before_params = jax.tree.map(np.asarray, params)
    rng = np.random.RandomState(0)
    prompts = [Prompt(rng.randint(1, 64, n).astype(np.int32), "", {}, "") for n in (15, 4, 16, 5)]
    groups = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    batches, _ = grpo.minibatches(s, groups, np.ones((4, 2), np.float32),
                                  np.ones(8, np.float32))
    assert {mb["tokens"].shape for b in batches for mb in b.micro} == {(2, 32), (1, 32)}
    before = compiles.snapshot()
    live = step_setup.Live()
    grpo.warm_up(s, live, params, batches)
    new = compiles.since(before)
    assert live.warmed == {(2, 32), (1, 32), (1, 16)}
    # [1, 16] through each program once (the step's own shapes compile in the step)
    assert new["jit(_accumulate)"] == new["jit(logprobs)"] == 1 and "jit(_apply)" not in new
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before_params)):
        np.testing.assert_array_equal(np.asarray(a), b)
    before = compiles.snapshot()
    grpo.warm_up(s, live, params, batches)
    assert not compiles.since(before)


def test_old_log_probs_from_the_trainer_give_the_mismatch_of_every_micro_batch():
    s = _mismatch_setup(mismatch_fraction=0.01, loss=dict(tis_cap=2.0, staleness_decay=0.5))
    assert s.rl.old_logp == "trainer"
    spec = grpo.micro_batch_spec(s.rl, TextTaskSpec(), None, 2, 32, False)
    assert {"old_logp", "rollout_logp", "sample_age"} <= set(spec)
    params = models.init_params(TINY, jax.random.key(2))
    rng = np.random.RandomState(1)
    prompts = [Prompt(rng.randint(1, 64, n).astype(np.int32), "", {}, "") for n in (4, 9)]
    groups = collect.rollout_groups(s, params, prompts, group_size=3, seed=0)
    groups = dataclasses.replace(groups, ages=np.array([0, 1, 2, 0, 1, 2]))
    batches, _ = grpo.minibatches(s, groups, np.ones((2, 3), np.float32),
                                  np.ones(6, np.float32))
    ages = np.concatenate([np.asarray(mb["sample_age"])[np.asarray(mb["loss_mask"]) > 0]
                           for b in batches for mb in b.micro])
    assert sorted(set(ages.tolist())) == [0.0, 1.0, 2.0]
    batches = grpo.old_and_ref_logps(s, params, batches)
    m = grpo.mismatch_metrics(s, batches)
    assert m["mismatch/micro_batches"] == sum(len(b.micro) for b in batches)
    assert m["mismatch/tokens"] == 6 * 8 and m["mismatch/abs_max"] < 1e-4
    kept = grpo.loss_inputs(s, batches)[0].micro[0]
    assert "rollout_logp" in kept and "response_pos" not in kept


class TextTaskSpec:
    def row_specs(self, rows, T):
        return {}


@pytest.mark.slow
def test_default_runlocal_with_rollout_corrections_and_mismatch_metrics(tmp_path):
    """The loop with every correction on: rollout log-probs and ages reach the compiled
    update, the trainer's old log-probs measure the mismatch of every micro-batch."""
    from tests.test_loop import tiny_config
    c = tiny_config(mismatch_fraction=0.5)
    c.reward.spec = "test_distinct_chars:1.0"
    c.rl.loss.update(tis_cap=2.0, tis_level="geometric", mask_level="token", mask_low=0.5,
                     mask_high=2.0, staleness_decay=0.9, max_staleness=4)
    m = loop.run(c, str(tmp_path))["grpo"]
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    # fp32 sampler and trainer: the correction leaves every token as it is.
    assert m["mismatch/micro_batches"] >= 1 and m["mismatch/abs_max"] < 1e-3
    assert m["masked_token_frac"] == 0.0 and m["masked_seq_frac"] == 0.0
    assert abs(m["tis_weight_mean"] - 1.0) < 1e-3 and m["staleness_weight_mean"] == 1.0
