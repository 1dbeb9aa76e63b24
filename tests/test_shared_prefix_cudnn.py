"""The shared-prompt prefix block on cuDNN (`flash_cudnn.CrossRuns`,
`shared_attention._prefix_cudnn`): the runs it builds, fed to a jnp stand-in for cuDNN's
packed layout, give the XLA prefix block's output, log-sum-exp and gradients; the real code
path with the stand-in in place of `flash_cudnn.fwd / bwd`; and, on a GPU, cuDNN itself.

B batch rows · T positions · N query heads · K kv heads · H head dim · G samples per prompt ·
E runs a row (cuDNN's segments) · I runs of all rows (B·E slots).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.data import shared_prompt as sp
from lrl.models import flash
from lrl.models import flash_cudnn as fc
from lrl.models import shared_attention as sa
from tests.jaxpr_util import cudnn_bwd_eqns
from tests.test_shared_prompt import groups_of, reference_attention

JUNK = jnp.nan   # what the stand-in leaves where cuDNN leaves values undefined


# ----------------------------------------------------------------------------- the stand-in

def _shift_to_left(x, fill):
    """jax's preprocessing of the packed layout (fused_attention_stablehlo): the entries
    >= 0 of all rows, in order, then `fill`."""
    flat = x.reshape(-1)
    idx = jnp.nonzero(flat >= 0, size=flat.size, fill_value=flat.size)[0]
    return jnp.take(flat, idx, fill_value=fill)


def compact(q_len, kv_len, q_off, kv_off, T, S):
    """[B, E] lengths and [B, E+1] per-row offsets -> the flat per-run arrays cuDNN gets
    (run i of all rows: lengths [I], offsets into the B·T (B·S) tokens [I+1]), in tokens."""
    B = q_len.shape[0]
    cum = lambda off, n: jnp.where(off >= 0, off + (jnp.arange(B) * n)[:, None], off)
    return (_shift_to_left(q_len, 0), _shift_to_left(kv_len, 0),
            _shift_to_left(cum(q_off, T), B * T), _shift_to_left(cum(kv_off, S), B * S))


def _runs(q, k, causal, q_len, kv_len, q_off, kv_off):
    """-> (ql, qo, ko [I], visible [I, B·T, B·S], q_member [I, B·T], k_member [I, B·S])."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    ql, kl, qo, ko = compact(q_len, kv_len, q_off, kv_off, T, S)
    I = ql.shape[0]
    qo, ko = qo[:I], ko[:I]
    p, s = jnp.arange(B * T), jnp.arange(B * S)
    qm = (p[None] >= qo[:, None]) & (p[None] < qo[:, None] + ql[:, None])
    km = (s[None] >= ko[:, None]) & (s[None] < ko[:, None] + kl[:, None])
    vis = qm[:, :, None] & km[:, None, :]
    if causal:   # equal runs only (the self block): key position in run <= query's
        vis &= (s[None, None] - ko[:, None, None]) <= (p[None, :, None] - qo[:, None, None])
    return ql, qo, vis, qm, km


def _scores(q, k, scale):
    """-> flat [N, B·T, B·S] scores (kv heads repeated to the query heads)."""
    B, T, N, H = q.shape
    kf = jnp.repeat(k.reshape(-1, k.shape[2], H), N // k.shape[2], axis=1)
    return jnp.einsum("pnh,snh->nps", q.reshape(B * T, N, H), kf) * scale


def reference_fwd(q, k, v, *, causal, scale, q_len=None, kv_len=None, q_off=None,
                  kv_off=None):
    """cuDNN's packed layout as jax hands it over (runs of all rows numbered in order, each
    with its own query and key offset and length): o [B,T,N,H] and stats [B·E, N, T], the
    stats of run i at slot i from position 0 of its query run; JUNK wherever cuDNN leaves
    values undefined (queries in no run, stats slots and positions past a run)."""
    assert q_off is not None, "the stand-in covers the packed layout only"
    B, T, N, H = q.shape
    ql, qo, vis, qm, _ = _runs(q, k, causal, q_len, kv_len, q_off, kv_off)
    s = jnp.where(vis[:, None], _scores(q, k, scale)[None], -jnp.inf)      # [I, N, BT, BS]
    lse = jax.nn.logsumexp(s, axis=-1)                                       # [I, N, BT]
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    vf = jnp.repeat(v.reshape(-1, v.shape[2], H), N // v.shape[2], axis=1)
    o_run = jnp.einsum("inps,snh->inph", p, vf)
    o = jnp.einsum("inph,ip->pnh", o_run, qm.astype(o_run.dtype))
    o = jnp.where(qm.any(0)[:, None, None], o, JUNK).reshape(B, T, N, H)
    t = jnp.arange(T)
    src = jnp.clip(qo[:, None] + t[None], 0, B * T - 1)                      # [I, T]
    stats = jnp.take_along_axis(lse, src[:, None, :], axis=2)                # [I, N, T]
    stats = jnp.where((t[None] < ql[:, None])[:, None], stats, JUNK)
    return o.astype(q.dtype), stats


def reference_bwd(q, k, v, o, stats, do, *, causal, scale, q_len=None, kv_len=None,
                  q_off=None, kv_off=None):
    """cuDNN's backward of the packed layout given any (o, per-run stats): per run,
    dS = P (dP - D) with D = rowsum(dO . O); JUNK for queries and keys in no run."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    ql, qo, vis, qm, km = _runs(q, k, causal, q_len, kv_len, q_off, kv_off)
    I = ql.shape[0]
    src = jnp.clip(jnp.arange(B * T)[None] - qo[:, None], 0, T - 1)           # [I, BT]
    lse = jnp.take_along_axis(stats[:I], src[:, None, :], axis=2)            # [I, N, BT]
    s = _scores(q, k, scale)[None]
    p = jnp.where(vis[:, None], jnp.exp(s - jnp.where(qm[:, None], lse, 0.0)[..., None]), 0.0)
    rep = lambda x: jnp.repeat(x.reshape(-1, K, H), N // K, axis=1)          # [BS, N, H]
    dof, of = do.reshape(B * T, N, H), o.reshape(B * T, N, H)
    delta = jnp.einsum("pnh,pnh->np", dof, of)
    dp = jnp.einsum("pnh,snh->nps", dof, rep(v))[None]
    ds = p * (dp - delta[None, :, :, None]) * scale                           # [I, N, BT, BS]
    dq = jnp.einsum("inps,snh->pnh", ds, rep(k))
    group = lambda x: x.reshape(B * S, K, N // K, H).sum(2)
    dk = group(jnp.einsum("inps,pnh->snh", ds, q.reshape(B * T, N, H)))
    dv = group(jnp.einsum("inps,pnh->snh", p, dof))
    junk = lambda x, m, n: jnp.where(m.any(0)[:, None, None], x, JUNK).reshape(B, n, *x.shape[1:])
    return junk(dq, qm, T), junk(dk, km, S), junk(dv, km, S)


def test_stand_in_preprocessing_is_jax_own():
    """The stand-in lays out runs as jax's own preprocessing does (the private function,
    where this jax has it): what ties it to what cuDNN is handed."""
    fix = getattr(fc._cudnn, "_fix_seqlen_offsets", None)
    if fix is None:
        pytest.skip("this jax has no _fix_seqlen_offsets")
    q_len = jnp.asarray([[3, 2, -1], [4, -1, -1]], jnp.int32)
    kv_len = jnp.asarray([[2, 5, -1], [1, -1, -1]], jnp.int32)
    q_off = jnp.asarray([[2, 9, -1, -1], [5, -1, -1, -1]], jnp.int32)
    kv_off = jnp.asarray([[0, 6, -1, -1], [0, -1, -1, -1]], jnp.int32)
    q, k = jnp.zeros((2, 16, 4, 8)), jnp.zeros((2, 16, 2, 8))
    want = fix(q_len, kv_len, q_off, kv_off, q, k)
    got = compact(q_len, kv_len, q_off, kv_off, 16, 16)
    for w, g, stride in zip(want, got, (1, 1, 4 * 8, 4 * 8)):
        np.testing.assert_array_equal(np.asarray(w).reshape(-1), np.asarray(g) * stride)


# ----------------------------------------------------------------------------- rows

def packed_rows(seed, G, row_len=48, rows=2, num_groups=4, prompt_len=(2, 12),
                completion_len=(0, 7), unshared=0, max_segments=30):
    """num_groups groups of G samples packed in the shared layout, plus `unshared` groups of
    G packed as plain sequences -> (segment ids, prefix ids) [B, T] int32."""
    rng = np.random.default_rng(seed)
    prompts, comps, groups = groups_of(rng, num_groups + unshared, G, prompt_len,
                                       completion_len)
    share = sp.share_groups(groups, [len(p) for p in prompts], [len(c) for c in comps], "on")
    share &= groups < num_groups
    b, _ = sp.pack_groups(prompts, comps, row_len, groups=groups, share=share,
                          max_segments=max_segments, min_rows=rows, rows_multiple=rows)
    return jnp.asarray(b["segment_ids"]), jnp.asarray(b["prefix_ids"])


def rows_of(*rows):
    """Hand-made rows: each a list of (segment id, prefix id, length) pieces; the rest pad."""
    T = max(sum(n for *_, n in r) for r in rows)
    seg, pre = np.zeros((len(rows), T), np.int32), np.zeros((len(rows), T), np.int32)
    for b, r in enumerate(rows):
        at = 0
        for s, p, n in r:
            seg[b, at:at + n], pre[b, at:at + n] = s, p
            at += n
    return jnp.asarray(seg), jnp.asarray(pre)


def qkv_do(seg, N=4, K=2, H=8, seed=0):
    rng = np.random.default_rng(seed)
    B, T = seg.shape
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return f(B, T, N, H), f(B, T, K, H), f(B, T, K, H), f(B, T, N, H)


def xla_prefix_block(q, k, v, seg, pre, o=None, lse=None, do=None):
    """The XLA prefix block (today's kernel) -> (o, lse) and, given a merged (o, lse) and
    dO, its (dq, dk, dv)."""
    kw = sa._prefix_xla_kw(sa._Opts(8 ** -0.5, None, 8, 8, 64), seg, pre)
    if do is None:
        return flash.block_attention(q, k, v, out_dtype=jnp.float32, **kw)
    return flash.block_attention_bwd(q, k, v, o, lse, do, **kw)


def cudnn_prefix_block(runs, q, k, v, o=None, lse=None, do=None):
    """The same block through `CrossRuns` and the stand-in."""
    if do is None:
        return runs.outputs(*reference_fwd(q, k, v, causal=False, scale=8 ** -0.5,
                                           **runs.kwargs))
    return runs.grads(*reference_bwd(q, k, v, o, runs.stats_of(lse), do, causal=False,
                                     scale=8 ** -0.5, **runs.kwargs))


def assert_blocks_match(seg, pre, max_runs, nan_rows=()):
    """Output, log-sum-exp and gradients of the prefix block agree (fp32) between the XLA
    kernel and CrossRuns through the stand-in; rows in `nan_rows` are NaN instead."""
    q, k, v, do = qkv_do(seg)
    runs = sa.prefix_runs(seg, pre, max_runs)
    np.testing.assert_array_equal(np.flatnonzero(runs.bad_B), list(nan_rows))
    ok = np.setdiff1d(np.arange(seg.shape[0]), list(nan_rows))
    o_x, l_x = xla_prefix_block(q, k, v, seg, pre)
    o_c, l_c = cudnn_prefix_block(runs, q, k, v)
    np.testing.assert_allclose(o_c[ok], o_x[ok], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(jnp.isfinite(l_c[ok]), jnp.isfinite(l_x[ok]))
    np.testing.assert_allclose(l_c[ok], l_x[ok], rtol=1e-5, atol=1e-5)   # -inf alike
    assert np.isnan(o_c[np.asarray(nan_rows, int)]).all()
    # the backward takes the merged attention's (o, lse): the whole layout's, as it runs
    o_m, l_m = sa._forward(sa._Opts(8 ** -0.5, "xla", 8, 8, 64), q, k, v, seg, pre)
    g_x = xla_prefix_block(q, k, v, seg, pre, o_m, l_m, do)
    g_c = cudnn_prefix_block(runs, q, k, v, o_m, l_m, do)
    for a, b, name in zip(g_c, g_x, ("dq", "dk", "dv")):
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-5, atol=1e-5, err_msg=name)
        assert np.isnan(a[np.asarray(nan_rows, int)]).all()
    return runs


# ----------------------------------------------------------------------------- the runs

@pytest.mark.slow
@pytest.mark.parametrize("G,row_len,prompt_len,completion_len,unshared", [
    (2, 48, (2, 12), (0, 7), 0), (3, 48, (2, 12), (0, 7), 1), (6, 48, (2, 12), (0, 7), 0),
    (4, 64, (20, 40), (1, 4), 1), (8, 40, (2, 6), (0, 3), 2), (2, 32, (2, 4), (5, 9), 0)])
def test_cross_runs_through_the_stand_in_equal_the_xla_prefix_block(
        G, row_len, prompt_len, completion_len, unshared):
    """Packed rows (several groups a row, groups cut over rows, unshared sequences mixed in,
    padding): the runs' offsets, lengths and stats slots, and the masks of what cuDNN leaves
    undefined, reproduce the XLA kernel's prefix block (o, lse, and dq, dk, dv)."""
    seg, pre = packed_rows(G * 10 + row_len, G, row_len, 3, prompt_len=prompt_len,
                           completion_len=completion_len, unshared=unshared)
    runs = assert_blocks_match(seg, pre, 10)
    assert int(runs.count_B.max()) >= 1
    if unshared:   # some tokens are in no run: their queries read nothing from this block
        assert not bool(runs.q_in_BT[seg > 0].all())


@pytest.mark.slow
def test_rows_of_more_groups_than_runs_are_nan_and_others_exact():
    """A row with more groups than the call's runs is NaN (output and gradients), never a
    wrong answer; the rows after it, whose runs cuDNN numbers after its, stay exact."""
    many = [(1, 1, 2), (2, 1, 2), (3, 1, 1), (4, 4, 3), (5, 4, 1), (6, 4, 2), (7, 7, 2),
            (8, 7, 1), (9, 7, 1)]                                  # three groups
    two = [(1, 1, 3), (2, 1, 2), (3, 1, 2), (4, 0, 4), (5, 5, 2), (6, 5, 3), (7, 5, 1)]
    seg, pre = rows_of(two, many, two[4:] + two[:3], many)   # row 2: ids 5, then 1
    assert_blocks_match(seg, pre, 2, nan_rows=(1, 3))
    assert_blocks_match(seg, pre, 3)


def test_packed_runs_row_of_too_many_segments_leaves_the_next_rows_exact():
    """The self block's `PackedRuns` through the stand-in: a row of more segments than
    max_segments is NaN, and the row after it (whose runs jax numbers after its) is exact."""
    seg, _ = rows_of([(1, 0, 3), (2, 0, 4), (3, 0, 5)],
                     [(i, 0, 1) for i in range(1, 10)] + [(10, 0, 3)], [(1, 0, 6), (2, 0, 6)])
    q, k, v, _ = qkv_do(seg)
    runs = fc.PackedRuns.of(seg, 4)
    o, stats = reference_fwd(q, k, v, causal=True, scale=8 ** -0.5, **runs.kwargs)
    o, lse = runs.nan_where_too_many(o), runs.stats_to_tokens(stats)
    o_x, l_x = flash.block_attention(q, k, v, mask_kind="causal", q_segment_ids=seg,
                                     kv_segment_ids=seg, implementation="xla")
    assert np.isnan(o[1]).all()
    for b in (0, 2):
        np.testing.assert_allclose(o[b], o_x[b], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[b], l_x[b], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_runs_are_matched_by_id_and_odd_rows_are_nan():
    """Rows the packer does not make, each with a good row around it: a prefix with no
    responses between two groups (matched by id, not by order); responses whose prefix is
    not in the row (they read nothing); and rows cuDNN cannot give exactly, NaN: a prefix
    after its responses, a prefix in two pieces, one prefix read by two runs of responses."""
    good = [(1, 1, 3), (2, 1, 2), (3, 1, 2)]
    seg, pre = rows_of(
        good,
        [(1, 1, 2), (2, 1, 2), (3, 1, 1), (4, 4, 3), (5, 5, 2), (6, 5, 2), (7, 5, 2)],
        [(1, 9, 2), (2, 9, 3), (3, 3, 2), (4, 3, 2), (5, 3, 1)],
        [(2, 1, 2), (3, 1, 2), (1, 1, 3)] + good,
        [(1, 1, 2), (2, 0, 2), (1, 1, 2), (3, 1, 3)],
        [(1, 1, 2), (2, 1, 2), (3, 0, 1), (4, 1, 2)])
    runs = assert_blocks_match(seg, pre, 4, nan_rows=(3, 4, 5))
    # row 1: queries of group 5 read keys 8..9 (group 4's prefix, 5..7, by nobody)
    np.testing.assert_array_equal(runs.kv_offsets_BE[1, :2], [0, 8])
    assert not bool(runs.kv_in_BS[1, 5:8].any())
    assert not bool(runs.q_in_BT[2, :5].any())                    # no prefix of id 9


@pytest.mark.slow
def test_packer_puts_a_group_in_one_row_its_prefix_first_ids_increasing():
    """The dense layout as `pack_groups` makes it (chunks, a cut, unshared sequences, caps on
    segments): each query run's keys are the run just before it (its prefix), in one row,
    and the groups' ids increase along the row, so the e-th key run and the e-th query run
    are one group: matching by id (what CrossRuns does) and by order agree."""
    for seed, G, row_len, ms, unshared in [(0, 2, 40, None, 1), (1, 5, 24, None, 0),
                                          (2, 8, 64, 6, 2), (3, 3, 32, 8, 3)]:
        seg, pre = packed_rows(seed, G, row_len, 2, unshared=unshared, max_segments=ms)
        runs = sa.prefix_runs(seg, pre, 16)
        assert not bool(runs.bad_B.any())
        for b in range(seg.shape[0]):
            n = int(runs.count_B[b])
            qo, ql = np.asarray(runs.q_offsets_BE[b, :n]), np.asarray(runs.q_lengths_BE[b, :n])
            ko, kl = np.asarray(runs.kv_offsets_BE[b, :n]), np.asarray(runs.kv_lengths_BE[b, :n])
            np.testing.assert_array_equal(ko + kl, qo)             # prefix, then responses
            assert (ql > 0).all()                                   # every group has responses
            ids = np.asarray(pre[b])[qo]
            assert (np.diff(ids) > 0).all()
            q_pre, kv_pre = sa.prefix_masks(seg, pre)
            key_ids = np.asarray(kv_pre[b])
            starts = np.flatnonzero((key_ids > 0) & (np.r_[-9, key_ids[:-1]] != key_ids))
            np.testing.assert_array_equal(key_ids[starts], ids)    # e-th key run: group e
    _, lay = sp.pack_groups(*groups_of(np.random.default_rng(4), 3, 4, (2, 9), (0, 5))[:2],
                            32, groups=np.arange(12) // 4, share=np.ones(12, bool))
    shared = lay["shared"]
    assert (lay["row"][shared] == lay["row"][shared]).all()
    for i in np.flatnonzero(shared):   # a response's prefix is in its row, just before
        assert lay["prefix_start"][i] < lay["start"][i]


# ----------------------------------------------------------------------------- the code path

def stand_in_cudnn(monkeypatch):
    """`flash_cudnn.fwd / bwd` replaced by the stand-in and cuDNN made available: the code
    path of the GPU, kernel aside. Returns the calls: (direction, causal, distinct runs)."""
    calls = []

    def fwd(q, k, v, **kw):
        calls.append(("fwd", kw["causal"], kw.get("q_off") is not kw.get("kv_off")))
        return reference_fwd(q, k, v, **kw)

    def bwd(q, k, v, o, lse, do, **kw):
        calls.append(("bwd", kw["causal"], kw.get("q_off") is not kw.get("kv_off")))
        return reference_bwd(q, k, v, o, lse, do, **kw)
    monkeypatch.setattr(fc, "unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(fc, "fwd", fwd)
    monkeypatch.setattr(fc, "bwd", bwd)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("G,unshared", [(1, 0), (2, 1), (3, 0), (6, 1)])
def test_shared_attention_cudnn_path_with_the_stand_in(monkeypatch, G, unshared):
    """`shared_attention` on its cuDNN path (self block packed, prefix block as CrossRuns)
    with the stand-in kernel: values and gradients of q, k, v equal the XLA path's and the
    masked reference's (fp32). G=1: nothing shared, the prefix kernel is skipped."""
    seg, pre = packed_rows(G + 50, G, 48, 2, unshared=unshared)
    q, k, v, do = qkv_do(seg, seed=G)

    def run(impl):
        fn = lambda q, k, v: sa.shared_attention(q, k, v, seg, pre, implementation=impl,  # noqa
                                                 q_chunk=8, kv_chunk=8)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))
    want = run("xla")
    ref_o = reference_attention(q, k, v, seg, pre)
    np.testing.assert_allclose(want[0], ref_o, rtol=1e-5, atol=1e-5)
    calls = stand_in_cudnn(monkeypatch)
    assert sa.kernel(q, k) == "cudnn"
    got = jax.jit(lambda q, k, v: run(None))(q, k, v)
    for a, b, name in zip(got, want, "oqkv"):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    # both blocks went to the kernel, the prefix block with distinct query and key runs
    assert set(calls) == {("fwd", True, False), ("bwd", True, False), ("fwd", False, True),
                          ("bwd", False, True)}
    assert sa.kernel(q, k, "xla") == "xla"


def test_cudnn_prefix_call_traces_through_jax(monkeypatch):
    """jax's own cuDNN attention accepts the prefix block's runs (distinct query and key
    offsets and lengths, mask PADDING) and our bound backward has the operands of jax's own
    VJP for them (traced only, so it runs on CPU; catches jax version drift)."""
    cud = fc._cudnn
    if cud is None or fc._CUDNN_BWD is None:
        pytest.skip("no cuDNN attention module in this jax")
    monkeypatch.setattr(cud, "check_cudnn_version", lambda: 90800)
    if hasattr(cud, "check_compute_capability"):
        monkeypatch.setattr(cud, "check_compute_capability", lambda *a: True)
    seg, pre = rows_of([(1, 1, 100), (2, 1, 60), (3, 1, 40), (4, 0, 56)])
    runs = sa.prefix_runs(seg, pre, 4)
    q = jnp.zeros((1, 256, 8, 128), jnp.bfloat16)
    k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    kw = runs.kwargs

    def theirs(q, k, v, do):
        f = lambda q, k, v: cud.dot_product_attention(
            q, k, v, None, None, kw["q_len"], kw["kv_len"], kw["q_off"], kw["kv_off"],
            scale=0.1, mask_type=cud.MaskType.PADDING, qkv_layout="BTNH")
        return jax.vjp(f, q, k, v)[1](do)

    def ours(q, k, v, do):
        o, lse = fc.fwd(q, k, v, causal=False, scale=0.1, **kw)
        assert lse.shape == (4, 8, 256)                             # [B·E, N, T]
        return fc.bwd(q, k, v, o, lse, do, causal=False, scale=0.1, **kw)

    args = (q, k, k, q)
    assert cudnn_bwd_eqns(ours, *args) == cudnn_bwd_eqns(theirs, *args) != []


# ----------------------------------------------------------------------------- GPU only

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="cuDNN itself: run with JAX_PLATFORMS=cuda on a GPU")


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


@on_gpu
def test_gpu_cudnn_prefix_block_and_shared_attention_match_xla():
    """bf16 cuDNN against the XLA kernel (fp32 inputs of the same values): the prefix block's
    o and lse (which confirms the stats layout of distinct query runs: slot per run across
    rows, position within the query run), its gradients, and the whole shared attention."""
    seg, pre = packed_rows(7, 4, 512, 3, prompt_len=(40, 200), completion_len=(10, 60),
                           unshared=1)
    # a row of no group, so the batch mixes rows of several, one and no runs
    seg = jnp.concatenate([seg, rows_of([(1, 0, 300), (2, 0, 212)])[0]])
    pre = jnp.concatenate([pre, jnp.zeros((1, 512), jnp.int32)])
    q, k, v, do = qkv_do(seg, N=8, K=2, H=128, seed=1)
    q16, k16, v16, do16 = (x.astype(jnp.bfloat16) for x in (q, k, v, do))
    runs = sa.prefix_runs(seg, pre, 8)
    assert int(runs.count_B.max()) >= 2 and not bool(runs.bad_B.any())
    opts = sa._Opts(128 ** -0.5, None, 512, 512, 24)
    kw = sa._prefix_xla_kw(opts, seg, pre)
    o_x, l_x = flash.block_attention(q, k, v, out_dtype=jnp.float32, **kw)
    o_c, l_c = jax.jit(lambda q, k, v: sa._prefix_cudnn(opts, q, k, v, runs))(q16, k16, v16)
    fin = jnp.isfinite(l_x)
    np.testing.assert_array_equal(jnp.isfinite(l_c), fin)
    assert rel_err(jnp.where(fin, l_c, 0), jnp.where(fin, l_x, 0)) < 1e-2
    assert rel_err(o_c, o_x) < 2e-2
    o_m, l_m = sa._forward(sa._Opts(128 ** -0.5, "xla", 512, 512, 24), q, k, v, seg, pre)
    g_x = flash.block_attention_bwd(q, k, v, o_m, l_m, do, **kw)
    g_c = jax.jit(lambda *a: sa._prefix_cudnn_bwd(opts, *a, runs))(
        q16, k16, v16, o_m.astype(jnp.bfloat16), l_m, do16)
    for gc, gx in zip(g_c, g_x):
        assert rel_err(gc, gx) < 5e-2
    assert sa.kernel(q16, k16) == "cudnn"

    def run(impl, q, k, v, do):
        fn = lambda q, k, v: sa.shared_attention(q, k, v, seg, pre, implementation=impl)  # noqa
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))
    got = jax.jit(lambda *a: run("cudnn", *a))(q16, k16, v16, do16)
    want = jax.jit(lambda *a: run("xla", *a))(q, k, v, do)
    for gc, gx in zip(got, want):
        assert rel_err(gc, gx) < 5e-2
