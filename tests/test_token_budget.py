"""The update cut by a token budget: micro-batches of a few shapes (full rows, and short
rows for a minibatch's last ones), driven from the host, give the one-big-batch step for any
number of them, on one device and on fsdp x seq; packing fills rows, packs the last ones
short and balances shards; the budget comes from the compiled update's memory (a shorter
row needs less), and one too small for a sample fails at start-up naming the key and the
sample's length."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lrl import build, compiles, config_util, models
from lrl import mesh as mesh_lib
from lrl.data import packing
from lrl.rl import budget as budget_lib
from lrl.rl import update as upd
from lrl.rl.losses import LossConfig
from tests.hf_util import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = models.ModelConfig(model_type="qwen2", vocab_size=96, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True, remat="none")


def _samples(rng, n, max_len=40):
    prompts = [rng.randint(1, 90, rng.randint(2, 8)).astype(np.int32) for _ in range(n)]
    comps = [rng.randint(1, 90, rng.randint(1, max_len)).astype(np.int32) for _ in range(n)]
    return prompts, comps


def _rows(rng, n, row_len, cut=None):
    prompts, comps = _samples(rng, n)
    adv = rng.randn(n).astype(np.float32)
    old = [(-rng.rand(len(c)) * 0.5).astype(np.float32) for c in comps]
    rows, _ = packing.pack(prompts, comps, row_len, seq_values={"advantages": adv},
                           token_values={"old_logp": old}, fit="best", max_segments=64,
                           cut=cut)
    return rows


def _fill(micro) -> float:
    return sum(int((mb["segment_ids"] > 0).sum()) for mb in micro) / sum(
        mb["tokens"].size for mb in micro)


@pytest.mark.parametrize("aggregation,sizes,attention", [
    ("token_mean", None, "dense"),
    # the fast tier's one case: the others (the ring's are its costliest tests) in the slow
    pytest.param("seq_mean_token_mean", None, "dense", marks=pytest.mark.slow),
    pytest.param("token_mean", {"fsdp": 2, "seq": 2}, "ring", marks=pytest.mark.slow),
    pytest.param("seq_mean_token_mean", {"fsdp": 2, "seq": 2}, "ring", marks=pytest.mark.slow)])
def test_host_micro_batches_equal_one_batch(aggregation, sizes, attention):
    rows = _rows(np.random.RandomState(0), 18, 64)
    mesh = mesh_lib.make_mesh(sizes, devices=jax.devices()[:4]) if sizes else None
    shards = 2 if sizes else 1
    cfg = CFG.replace(attention=attention)
    params = models.init_params(cfg, jax.random.key(0), mesh)
    before = jax.tree.map(np.asarray, params)
    tx = optax.sgd(1e4)        # new params = params - 1e4 grads: gradients show, no cancellation
    loss = LossConfig(aggregation=aggregation, max_len=40, clip_low=0.1, clip_high=0.1)
    state = upd.init_train_state(params, tx)
    # The reference: every row in one program, one micro-batch.
    whole = {k: np.concatenate([v, np.zeros((-len(v) % shards,) + v.shape[1:], v.dtype)])
             for k, v in rows.items()}
    ref_state, ref = upd.make_update_fn(cfg, loss, tx, mesh)(
        jax.tree.map(jnp.copy, state), mesh_lib.put_batch(mesh, whole))
    ref_params = jax.tree.map(np.asarray, ref_state.params)
    u = upd.make_update_programs(cfg, loss, tx, mesh)
    counts = set()
    # Three cuts into full rows, one with the last rows cut short, and one of the same
    # samples packed for that: its last rows packed again into short ones.
    short = packing.Cut(shards, 2, (64, 32, 16))
    cuts = [(rows, packing.Cut(shards, k, (64,))) for k in (1, 2, 3)] + [
        (rows, short), (_rows(np.random.RandomState(0), 18, 64, cut=short), short)]
    for rows, cut in cuts:
        micro = packing.micro_batches(rows, cut)
        counts.add(tuple(mb["tokens"].shape for mb in micro))
        denoms = upd.host_denominators(micro, loss.max_len)
        got_state, got = upd.run_update(u, jax.tree.map(jnp.copy, state),
                                        [mesh_lib.put_batch(mesh, mb) for mb in micro], denoms)
        for k in ("loss", "pg_loss", "grad_norm", "ratio_max", "ratio_min", "clip_frac_low",
                  "tokens", "sequences"):
            assert abs(float(got[k]) - float(ref[k])) <= 1e-5 * max(1.0, abs(float(ref[k]))), k
        for a, b, w in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(ref_params),
                           jax.tree.leaves(before)):
            assert rel_err(np.asarray(a) - w, b - w) < 1e-4
    assert len(counts) >= 4 and float(ref["clip_frac_low"]) + float(ref["clip_frac_high"]) > 0
    # Full rows of 2 a shard, their last ones cut short, packed short: each fills more (the
    # last alike on one shard, where the last row was short already).
    fills = [_fill(packing.micro_batches(r, c)) for r, c in [cuts[1]] + cuts[3:]]
    assert fills[0] < fills[1] <= fills[2] and fills[1] < fills[2] or shards == 1, fills


def test_micro_batch_shapes_compile_once_for_any_count():
    rng = np.random.RandomState(1)
    tx = optax.adam(1e-3)
    loss = LossConfig(aggregation="token_mean", max_len=40)
    u = upd.make_update_programs(CFG, loss, tx)
    state = upd.init_train_state(models.init_params(CFG, jax.random.key(0)), tx)
    cut = packing.Cut(1, 2, (64, 32, 16))
    shapes, before = set(), compiles.snapshot()
    for n in (3, 11, 25, 40):   # micro-batches of [2, 64], the last rows in [1, 64 / 32 / 16]
        micro = packing.micro_batches(_rows(rng, n, 64, cut=cut), cut)
        shapes |= {mb["tokens"].shape for mb in micro}
        state, m = upd.run_update(u, state, [mesh_lib.put_batch(None, mb) for mb in micro],
                                  upd.host_denominators(micro, 40))
        assert np.isfinite(float(m["loss"]))
    assert shapes <= {(cut.shards * k, n) for k, n in cut.shapes()} and len(shapes) > 2
    assert u.programs.accumulate._cache_size() == len(shapes)     # one program per shape
    counts = compiles.since(before)
    assert counts["jit(_start)"] == 1 and counts["jit(_apply)"] == 1   # one for any shape


def test_no_empty_micro_batch_of_one_row_micro_batches():
    """8 rows of one shard in micro-batches of k rows, then of one row: none empty (an empty
    one would still cost a forward and backward; a run's first step runs its shapes ahead of
    need instead, `lrl.grpo.minibatches`), unless the plan asks for it."""
    seg = np.ones((8, 16), np.int32)
    rows = {"tokens": np.arange(8 * 16, dtype=np.int32).reshape(8, 16), "segment_ids": seg}
    for k, want in ((1, [1] * 8), (2, [2] * 4), (4, [4, 4]), (3, [3, 3, 1, 1])):
        micro = packing.micro_batches(rows, packing.Cut(1, k, (16,)))
        assert [mb["tokens"].shape[0] for mb in micro] == want, k
        assert sum(int((mb["segment_ids"] > 0).sum()) for mb in micro) == 8 * 16
        assert all((mb["segment_ids"] > 0).any() for mb in micro)
    cut = packing.Cut(1, 2, (16, 8))
    micro = packing.micro_batches(rows, cut, plan=packing.micro_plan(rows, cut) + ((1, 8),))
    assert [mb["tokens"].shape for mb in micro] == [(2, 16)] * 4 + [(1, 8)]
    assert not micro[-1]["segment_ids"].any()


def test_last_rows_are_cut_to_the_shortest_length_that_holds_them():
    """Rows of 32, 32, 30, 12, 9 and 5 tokens over one shard of 2 rows a micro-batch: the
    full ones (no shorter length holds them) in [2, T] and [1, T], the others each in the
    shortest of T/2, T/4 that holds it; every per-row array, M-RoPE positions [B, 3, T] too,
    is cut alike, and no token is lost."""
    T = 32
    extents = [32, 32, 30, 12, 9, 5]
    seg = np.zeros((len(extents), T), np.int32)
    for r, n in enumerate(extents):
        seg[r, :n] = 1 + np.arange(n) // 4
    rows = {"segment_ids": seg, "tokens": np.where(seg > 0, 7 + np.arange(T), 0),
            "advantages": np.where(seg > 0, 0.5, 0.0).astype(np.float32),
            "positions": np.where(seg > 0, np.arange(T), 0)[:, None, :].repeat(3, axis=1)}
    cut = packing.Cut(1, 2, (32, 16, 8))
    plan = packing.micro_plan(rows, cut)
    assert plan == ((2, 32), (1, 32), (1, 16), (1, 16), (1, 8))
    micro = packing.micro_batches(rows, cut, plan=plan)
    for mb, (k, n) in zip(micro, plan):
        assert {x.shape[0] for x in mb.values()} == {k} and mb["positions"].shape == (k, 3, n)
        assert {x.shape[-1] for x in mb.values()} == {n}
    for key, x in rows.items():
        assert sum(float(np.abs(mb[key]).sum()) for mb in micro) == float(np.abs(x).sum()), key
    assert [int((mb["segment_ids"] > 0).sum()) for mb in micro] == [64, 30, 12, 9, 5]
    with pytest.raises(ValueError, match="a row of 9 tokens in a micro-batch of rows of 8"):
        packing.micro_batches(rows, cut, plan=plan[:3] + ((1, 8), (1, 8)))
    with pytest.raises(ValueError, match="holds 4 rows a shard, a shard has 6"):
        packing.micro_batches(rows, cut, plan=plan[:3])
    with pytest.raises(ValueError, match="rows of 32 tokens for a cut of 64"):
        packing.micro_batches(rows, packing.Cut(1, 2, (64,)))


def test_processes_agree_on_one_plan_that_holds_every_process_rows():
    """Two processes' rows (one with a K-row micro-batch more, the other with longer last
    rows) cut by one plan: the fewest K-row micro-batches, then the longest length either
    needs at each one-row micro-batch; each process's rows fit it."""
    rng = np.random.RandomState(4)
    cut = packing.Cut(2, 2, (64, 32, 16))
    rows = [_rows(rng, n, 64, cut=cut) for n in (30, 14)]
    plans = [packing.micro_plan(r, cut) for r in rows]
    common = packing.common_plan(plans, cut)
    assert plans[0] != plans[1] and common == packing.common_plan(plans[::-1], cut)
    blocks = min(p.count((2, 64)) for p in plans)
    assert common[:blocks] == ((2, 64),) * blocks and (2, 64) not in common[blocks:]
    for r in rows:
        micro = packing.micro_batches(r, cut, plan=common)
        assert [mb["tokens"].shape for mb in micro] == [(2 * k, n) for k, n in common]
        assert sum(int((mb["segment_ids"] > 0).sum()) for mb in micro) == int(
            (r["segment_ids"] > 0).sum())
    assert packing.common_plan([plans[0]], cut) == plans[0]


def test_the_last_rows_are_packed_short_the_issue_case():
    """The shapes of issue #21 (one shard, 2 rows of 8192 a micro-batch, minibatches of 64
    samples of a ~25-token prompt and a log-normal response of mean 300, at most 1024): best
    fit with the cut packs the last rows into rows of 4K / 2K / 1K, every minibatch fills
    >= 90% of what it computes (about 80% in full rows), and the rows still hold every
    sequence once."""
    rng = np.random.default_rng(0)
    full, short = packing.Cut(1, 2, (8192,)), packing.Cut(1, 2, (8192, 4096, 2048, 1024))
    before, after = [], []
    for _ in range(20):
        prompts = [np.ones(n, np.int32) for n in rng.integers(15, 40, 64)]
        comps = [np.full(n, 3, np.int32) for n in
                 np.clip(rng.lognormal(np.log(300) - 0.5, 1.0, 64).astype(int), 1, 1024)]
        kw = dict(fit="best", max_segments=63)
        plain, _ = packing.pack(prompts, comps, 8192, **kw)
        packed, layout = packing.pack(prompts, comps, 8192, cut=short, **kw)
        before.append(_fill(packing.micro_batches(plain, full)))
        micro = packing.micro_batches(packed, short)
        after.append(_fill(micro))
        assert {mb["tokens"].shape for mb in micro} <= {(2, 8192), (1, 8192), (1, 4096),
                                                         (1, 2048), (1, 1024)}
        out = packing.unpack(packed, layout)
        assert all(len(c) == len(w) for c, w in zip(out["completions"], comps))
        assert packed["loss_mask"].sum() == sum(len(c) for c in comps)
    assert min(after) >= 0.9 and np.mean(after) > 0.95 and np.mean(before) < 0.85


def test_best_fit_fills_rows_balances_shards_and_bounds_segments():
    rng = np.random.RandomState(2)
    lengths = np.minimum(rng.lognormal(4.0, 1.0, 500).astype(int) + 2, 1000)
    row, start = packing.best_fit(lengths, 1024, max_segments=32)
    rows = int(row.max()) + 1
    assert rows <= -(-lengths.sum() // 1024) + 2        # within two rows of perfect
    for r in range(rows):
        placed = np.flatnonzero(row == r)
        assert len(placed) <= 32 and lengths[placed].sum() <= 1024
        spans = sorted((start[i], start[i] + lengths[i]) for i in placed)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))   # no overlap
    prompts, comps = _samples(rng, 200, 200)
    batch, layout = packing.pack(prompts, comps, 512, fit="best", max_segments=8)
    micro = packing.micro_batches(batch, packing.Cut(4, 2, (512,)))
    assert all((mb["segment_ids"] > 0).any() for mb in micro)
    total = sum(int((mb["segment_ids"] > 0).sum()) for mb in micro)
    assert total == int((batch["segment_ids"] > 0).sum())
    per_shard = [sum(int((mb["segment_ids"][s * 2:(s + 1) * 2] > 0).sum()) for mb in micro)
                 for s in range(4)]
    assert max(per_shard) - min(per_shard) <= 512    # at most one row apart
    rows = int((batch["segment_ids"] > 0).any(axis=1).sum())
    assert total / (rows * 512) > 0.9                    # the rows are full
    assert len(micro) == -(-rows // 8)                   # and only the last micro-batch is not


def test_a_budget_too_small_for_one_sample_fails_at_start_up():
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"))
    c.rl.update(row_len=0, max_tokens_per_micro=128)
    with pytest.raises(ValueError, match=r"rl.max_tokens_per_micro=128: a sample can have 200 "
                                         r"tokens \(data.max_prompt_len=160 \+ "
                                         r"rl.max_new_tokens=40\)"):
        build.options(c)
    c.rl.update(row_len=256, max_tokens_per_micro=128)
    with pytest.raises(ValueError, match="rl.row_len=256 > rl.max_tokens_per_micro=128"):
        build.options(c)
    with pytest.raises(ValueError, match="cannot hold one sample.*a sample can have 5000"):
        budget_lib.resolve(row_len=0, max_tokens=0, longest=5000, unit=1,
                           need_bytes=lambda rows, n: 10 * n, available=20_000)


def test_the_budget_is_derived_from_the_compiled_update():
    loss = LossConfig(aggregation="token_mean", max_len=40)
    tx = optax.adam(1e-3)
    u = upd.make_update_programs(CFG, loss, tx)
    params = models.init_params(CFG, jax.random.key(0))
    from lrl import grpo, options
    rl = options.from_config(config_util.load(os.path.join(ROOT, "configs", "default.py")),
                             check_files=False).rl

    class Text:
        def row_specs(self, rows, T):
            return {}

    def need(rows, T):
        return upd.need_bytes(u, params, grpo.micro_batch_spec(rl, Text(), None, rows, T, False))

    n1, n2, n4 = need(1, 256), need(2, 256), need(4, 256)
    assert 0 < n1 < n2 < n4                            # activations grow with the tokens
    # A minibatch's last rows, cut short, need less than full ones: the budget holds for them.
    assert 0 < need(1, 128) < n1 and budget_lib.row_lengths(256, 1) == (256, 128)
    assert budget_lib.row_lengths(8192, 4) == (8192, 4096, 2048, 1024)
    assert budget_lib.row_lengths(9000, 8) == (9000, 4608, 2304, 1152)   # whole tiles
    assert budget_lib.row_lengths(128, 1) == (128,)
    got = budget_lib.resolve(row_len=256, max_tokens=0, longest=200, unit=1, need_bytes=need,
                             available=(n2 + n4) // 2)
    assert got.derived and got.rows_per_shard in (2, 3) and got.need_bytes <= (n2 + n4) // 2
    # rl.row_len=0: a row of the longest sample (at least the floor), rows from memory
    rows = budget_lib.resolve(row_len=0, max_tokens=0, longest=200, unit=1, need_bytes=need,
                              available=need(3, 256) + 1, row_floor=256)
    assert (rows.row_len, rows.rows_per_shard) == (256, 3)
    assert budget_lib.smallest_shape(row_len=0, max_tokens=0, longest=200, unit=1,
                                     row_floor=256) == (1, 256)
    cpu = budget_lib.resolve(row_len=0, max_tokens=0, longest=200, unit=4)
    assert (cpu.row_len, cpu.rows_per_shard) == (256, 1)   # no memory reading: one sample's row


def test_a_shape_whose_compile_runs_out_of_memory_does_not_fit():
    """XLA's GPU autotuner runs a candidate's kernels on full-size buffers while compiling,
    so the search's larger guesses may fail to compile at all: the build's `need` calls that
    NO_FIT (`budget.out_of_memory` tells the error), and the search settles below it."""
    err = RuntimeError("NOT_FOUND: All configs failed during profiling.\nEXECUTION FAILED: "
                       "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 157.66GiB")
    assert budget_lib.out_of_memory(err) and not budget_lib.out_of_memory(ValueError("shape"))
    tried = []

    def need(rows, T):
        tried.append(rows)
        return budget_lib.NO_FIT if rows >= 8 else 1000 * rows
    got = budget_lib.resolve(row_len=256, max_tokens=0, longest=200, unit=1, need_bytes=need,
                             available=5_500)
    assert got.rows_per_shard == 5 and got.need_bytes == 5000 and max(tried) <= 64
    # A line through 1 and 2 rows that says everything fits guesses the top; its compile
    # failing leaves a size that fits.
    tried.clear()
    flat = budget_lib.resolve(row_len=256, max_tokens=0, longest=200, unit=1,
                              need_bytes=lambda rows, T: tried.append(rows) or (
                                  budget_lib.NO_FIT if rows >= 8 else 1000 + rows),
                              available=10**6)
    assert 2 <= flat.rows_per_shard < 8 and flat.need_bytes < 10**6


def test_the_search_draws_its_first_line_through_a_shape_the_step_compiles():
    """The first line's second point is one row of half the length, which a minibatch's last
    rows compile anyway (`packing.Cut.shapes`): where one full row is all that fits, the
    search compiles nothing the step does not run (on the H100 a 1.5B update's two-row probe
    cost a compile of its own); where more fit, the line finds them as through 1 and 2 rows;
    a row's length that adds memory faster than rows do errs short, never past the fit."""
    GiB = 2**30

    def search(f, available, row_len=8192, unit=4):
        tried = []
        got = budget_lib.resolve(row_len=row_len, max_tokens=0, longest=200, unit=unit,
                                 need_bytes=lambda rows, T: tried.append((rows, T)) or f(rows, T),
                                 available=available)
        cut = packing.Cut(1, got.rows_per_shard, budget_lib.row_lengths(got.row_len, unit))
        return got.rows_per_shard, tried, set(tried) - set(cut.shapes())

    linear = lambda rows, T: 9 * GiB + rows * T * 2 * 2**20   # 16 GiB a row of 8K
    # One row fits, two do not: two compiles, both shapes the step runs.
    assert search(linear, 40 * GiB) == (1, [(1, 8192), (1, 4096)], set())
    # Two fit exactly: the line says so and one compile checks it.
    got, tried, extra = search(linear, 41 * GiB)
    assert got == 2 and tried == [(1, 8192), (1, 4096), (2, 8192)] and extra == set()
    # More rows: found as the line through one and two full rows found them.
    got, tried, _ = search(linear, 139 * GiB)
    best = max(k for k in range(1, 65) if linear(k, 8192) <= 139 * GiB)
    assert got == best and len(tried) == 3
    # Quadratic in a row's length (XLA's own attention), linear in rows: short of the fit.
    quad = lambda rows, T: 9 * GiB + rows * (T * 2**20 + T * T * 2**7)
    best = max(k for k in range(1, 65) if quad(k, 8192) <= 120 * GiB)
    got, tried, _ = search(quad, 120 * GiB)
    assert best * 7 / 8 <= got <= best and len(tried) <= 6
    # A need the length does not change (the optimizer step dominates): 2 full rows measured.
    flat = lambda rows, T: 20 * GiB + rows * 2**20
    assert search(flat, 40 * GiB)[1][:3] == [(1, 8192), (1, 4096), (2, 8192)]


def test_the_search_compiles_few_shapes_a_right_line_three():
    """Each shape the search compiles costs seconds of a first start (~6.5 s for a 1.5B
    update on an H200): a need that grows linearly is found with the line through 1 and 1/2
    a row and one compile that checks it, where bisecting toward the top compiled four more
    shapes that all failed; a need that grows faster ends within an eighth of the largest
    that fits."""
    GiB = 2**30

    def search(f, available):   # f of the micro-batch's tokens, in full rows
        tried = []
        got = budget_lib.resolve(row_len=256, max_tokens=0, longest=200, unit=1,
                                 need_bytes=lambda rows, T: tried.append(rows * T / 256) or f(
                                     rows * T / 256),
                                 available=available)
        best = max(k for k in range(1, 65) if f(k) <= available)
        return got.rows_per_shard, best, tried

    assert search(lambda k: 20 * GiB + 3 * GiB * k, 120 * GiB) == (33, 33, [1, 0.5, 33])
    assert search(lambda k: 60 * GiB + 9 * GiB * k, 100 * GiB) == (4, 4, [1, 0.5, 4])
    got, best, tried = search(lambda k: 40 * GiB + 4 * GiB * k + 0.3 * GiB * k * k, 110 * GiB)
    assert best * 7 / 8 <= got <= best and len(tried) <= 6 and len(set(tried)) == len(tried)
    # Less than an eighth more is not worth a compile; a concave need (XLA reusing buffers)
    # is followed up past the line's first guess.
    got, best, tried = search(lambda k: 20 * GiB + 6 * GiB * min(k, 3) + 2 * GiB * max(k - 3, 0),
                              100 * GiB)
    assert got == best == 34 and len(tried) <= 6


def test_long_rows_hold_fewer_runs_on_cudnns_packed_attention():
    """cuDNN's packed backward takes E x T x N x H x 8 bytes whatever the runs hold
    (docs/benchmark-history.md, "Seventeenth session": 55.6 GiB at E = 64 for a 32K-token row of 7B
    heads): a row of T tokens gets E within `flash.PACKED_ROW_BYTES`, between what one unit
    of packing needs and 64, and the update's model config and packer take it from the rows'
    length (a shared group, its prefix and the padding in one row at least)."""
    from lrl import options
    from lrl.models import flash
    assert flash.segments_for(4096, 12, 128) == 64            # Qwen2.5-1.5B heads
    assert flash.segments_for(8192, 12, 128) == 42
    assert flash.segments_for(16384, 12, 128) == 21
    assert flash.segments_for(66560, 12, 128) == 5
    assert flash.segments_for(66560, 12, 128, least=10) == 10
    assert flash.segments_for(16384, 28, 128) == 9            # Qwen2.5-7B heads
    assert flash.segments_for(131072, 28, 128) == 2
    for T, N in ((8192, 12), (16384, 28), (131072, 28)):
        E = flash.segments_for(T, N, 128)
        assert E == 2 or E * T * N * 128 * 8 <= flash.PACKED_ROW_BYTES
    with pytest.raises(ValueError, match="max_segments=1"):
        CFG.replace(max_segments=1)
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"))
    c.rl.update(row_len=32768, max_tokens_per_micro=0)
    rl = options.from_config(c, check_files=False).rl
    big = CFG.replace(n_heads=12, head_dim=128)
    sizes = dict(row_len=rl.row_len, max_tokens=0, longest=None, unit=1)
    assert build.update_model_config(big, rl, sizes).max_segments == 10
    shared = dataclasses.replace(rl, shared_prompt="auto")
    assert build.update_model_config(big, shared, dict(sizes, row_len=10**6)).max_segments == \
        shared.group_size + 2
    # rl.row_len=0: the rows the budget derives hold the longest sample, 8K tokens at least
    derived = dict(row_len=0, max_tokens=0, longest=200, unit=1)
    assert build.update_model_config(big, rl, derived).max_segments == 42
