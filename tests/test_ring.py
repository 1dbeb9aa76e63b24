"""The per-block kernel (lrl.models.flash) and ring attention (lrl.models.ring) against a
naive dense reference: values, log-sum-exp and gradients; layouts; per-device memory.

B batch · T query positions · S key/value positions · N query heads · K kv heads · H head dim.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from lrl.mesh import make_mesh
from lrl.models import flash, flash_cudnn, ring
from tests.jaxpr_util import cudnn_bwd_eqns


def reference(q, k, v, q_seg, kv_seg, q_idx, kv_idx):
    """Materialised scores; rows that see nothing give (0, -inf)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k) * H ** -0.5
    vis = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_idx[:, None, :] <= q_idx[:, :, None])
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    seen = vis.any(-1)[:, None, None, :]
    p = jnp.where(seen[..., None], jnp.exp(s - jnp.where(seen, lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)
    return o, lse.reshape(B, N, T)


def causal_reference(q, k, v, seg):
    idx = jnp.broadcast_to(jnp.arange(q.shape[1]), seg.shape)
    return reference(q, k, v, seg, seg, idx, idx)[0]


def rel_err(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def qkv(rng, B, T, N, K, H, S=None):
    S = T if S is None else S
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return f(B, T, N, H), f(B, S, K, H), f(B, S, K, H)


def packed_segments(rng, B, T, n_segments):
    """Sorted ids: contiguous segments whose boundaries fall anywhere (not on shards)."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=(B, n_segments - 1)), axis=1)
    return jnp.asarray((np.arange(T)[None, None] >= cuts[:, :, None]).sum(1), jnp.int32)


# ----------------------------------------------------------------------------- layouts

def test_zigzag_permutation_and_inverse():
    perm = ring.zigzag_permutation(8, 2)
    np.testing.assert_array_equal(perm, [0, 1, 6, 7, 2, 3, 4, 5])
    assert perm.dtype == np.int32
    x = np.arange(24) * 10
    perm = ring.zigzag_permutation(24, 3)
    np.testing.assert_array_equal(x[perm][ring.inverse_permutation(perm)], x)
    with pytest.raises(ValueError, match="divide by 2 x 2"):
        ring.zigzag_permutation(10, 2)


# ----------------------------------------------------------------------------- flash

def test_attention_with_lse_matches_reference_values_lse_grads():
    rng = np.random.default_rng(0)
    B, T, S, N, K, H = 2, 13, 11, 4, 2, 8
    q, k, v = qkv(rng, B, T, N, K, H, S)
    q_seg, kv_seg = jnp.asarray(rng.integers(0, 3, (B, T))), jnp.asarray(rng.integers(0, 3, (B, S)))
    q_idx = jnp.asarray(rng.integers(0, 20, (B, T)))
    kv_idx = jnp.asarray(rng.integers(0, 20, (B, S)))
    q_seg = q_seg.at[0, 3].set(7)  # a segment no key has: a fully masked row
    kw = dict(q_segment_ids_BT=q_seg, kv_segment_ids_BS=kv_seg, q_index_BT=q_idx,
              kv_index_BS=kv_idx)
    ours = lambda q, k, v: flash.attention_with_lse(q, k, v, **kw, q_chunk=4, kv_chunk=3)
    ref = lambda q, k, v: reference(q, k, v, q_seg, kv_seg, q_idx, kv_idx)
    (o, lse), (o_ref, lse_ref) = jax.jit(ours)(q, k, v), ref(q, k, v)
    assert rel_err(o, o_ref) < 1e-5
    masked = np.isinf(np.asarray(lse_ref))
    assert masked[0, :, 3].all()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), masked)
    np.testing.assert_allclose(np.where(masked, 0, lse), np.where(masked, 0, lse_ref), atol=1e-5)
    assert float(jnp.abs(o[0, 3]).max()) == 0.0

    w = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
    wl = jnp.asarray(rng.normal(size=lse.shape), jnp.float32)

    def loss(fn):  # uses both outputs, so the lse cotangent is checked too
        def f(q, k, v):
            o, lse = fn(q, k, v)
            return (o * w).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * wl).sum()
        return f
    grads = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v)
    grads_ref = jax.grad(loss(ref), (0, 1, 2))(q, k, v)
    for g, g_ref in zip(grads, grads_ref):
        assert not np.isnan(np.asarray(g)).any()
        assert rel_err(g, g_ref) < 1e-4
    assert float(jnp.abs(grads[0][0, 3]).max()) == 0.0


def test_block_attention_bwd_with_global_lse_sums_to_dense_grads():
    """Two key blocks, each backward given the merged o and lse, add up to the dense grads."""
    rng = np.random.default_rng(1)
    B, T, N, K, H = 1, 12, 2, 1, 8
    q, k, v = qkv(rng, B, T, N, K, H)
    seg = packed_segments(rng, B, T, 3)
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    c = T // 2
    block, block_bwd = (jax.jit(f, static_argnames=("mask_kind", "q_chunk", "kv_chunk"))
                        for f in (flash.block_attention, flash.block_attention_bwd))
    # queries = second half; keys: first half ("full": all earlier) and second half ("causal")
    qh, sq = q[:, c:], seg[:, c:]
    o1, l1 = block(qh, k[:, :c], v[:, :c], mask_kind="full", q_segment_ids=sq,
                                   kv_segment_ids=seg[:, :c], q_chunk=4, kv_chunk=4)
    o2, l2 = block(qh, k[:, c:], v[:, c:], mask_kind="causal", q_segment_ids=sq,
                                   kv_segment_ids=sq, q_chunk=4, kv_chunk=4)
    o, lse = ring._merge(o1, l1, o2, l2)
    o_ref = causal_reference(q, k, v, seg)[:, c:]
    assert rel_err(o, o_ref) < 1e-5
    dq1, dk1, dv1 = block_bwd(qh, k[:, :c], v[:, :c], o, lse, do[:, c:],
                                              mask_kind="full", q_segment_ids=sq,
                                              kv_segment_ids=seg[:, :c])
    dq2, dk2, dv2 = block_bwd(qh, k[:, c:], v[:, c:], o, lse, do[:, c:],
                                              mask_kind="causal", q_segment_ids=sq,
                                              kv_segment_ids=sq)
    _, vjp = jax.vjp(lambda q, k, v: causal_reference(q, k, v, seg)[:, c:], q, k, v)
    dq, dk, dv = vjp(do[:, c:])
    assert rel_err(dq1 + dq2, dq[:, c:]) < 1e-4
    assert rel_err(jnp.concatenate([dk1, dk2], 1), dk) < 1e-4
    assert rel_err(jnp.concatenate([dv1, dv2], 1), dv) < 1e-4
    with pytest.raises(ValueError, match="mask_kind"):
        flash.block_attention(q, k[:, :c], v[:, :c], mask_kind="causal")


def test_dense_attention_xla_and_segment_runs():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 20, 4, 2, 8)
    seg = packed_segments(rng, 2, 20, 4)
    o = jax.jit(lambda q, k, v: flash.dense_attention(q, k, v, seg, implementation="xla",
                                                      q_chunk=8, kv_chunk=8))(q, k, v)
    assert rel_err(o, causal_reference(q, k, v, seg)) < 1e-5
    offsets, lengths, count = flash_cudnn.segment_runs(jnp.asarray([[1, 1, 2, 2, 2, 0, 0]]), 4)
    np.testing.assert_array_equal(offsets, [[0, 2, 5, -1, -1]])
    np.testing.assert_array_equal(lengths, [[2, 3, 2, -1]])
    np.testing.assert_array_equal(count, [3])
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="cuDNN requested but unusable"):
            flash.dense_attention(q, k, v, seg, implementation="cudnn")


# ----------------------------------------------------------------------------- ring

def ring_vs_dense(n, layout, N, K, segmented=True, B=2, T=48, H=8, seed=0, implementation=None):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, B, T, N, K, H)
    seg = packed_segments(rng, B, T, 4) if segmented else jnp.zeros((B, T), jnp.int32)
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    mesh = make_mesh({"seq": n, "fsdp": -1})
    perm = ring.layout_permutation(T, n, layout)
    inv = ring.inverse_permutation(perm)

    def ours(q, k, v):  # natural order in and out; the layout is applied around the ring
        o = ring.ring_attention(q[:, perm], k[:, perm], v[:, perm],
                                seg[:, perm] if segmented else None, mesh=mesh,
                                layout=layout, implementation=implementation, q_chunk=4,
                                kv_chunk=5)
        return o[:, inv]

    def with_grads(fn):
        def f(q, k, v):
            o, vjp = jax.vjp(fn, q, k, v)
            return o, vjp(do)
        return f
    o, grads = jax.jit(with_grads(ours))(q, k, v)
    o_ref, grads_ref = with_grads(lambda q, k, v: causal_reference(q, k, v, seg))(q, k, v)
    assert rel_err(o, o_ref) < 1e-5, (n, layout)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-4, (n, layout, name)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_zigzag_packed_gqa_matches_dense(n):
    ring_vs_dense(n, "zigzag", N=4, K=2)


@pytest.mark.parametrize("n,layout,segmented", [(4, "contiguous", True), (4, "zigzag", False),
                                                (1, "zigzag", True)])
def test_ring_mha_contiguous_unsegmented_single_shard(n, layout, segmented):
    ring_vs_dense(n, layout, N=2, K=2, segmented=segmented, seed=n)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_gradient_program_has_no_zero_sized_operands(n):
    """XLA's GPU compiler (jax 0.11.2) segfaulted in its Shardy pass on the ring's gradient
    over two GPUs: a full-window `.at[].add` made an empty index constant that shard_map
    passed in as an s32[0] operand. The lowered program must hold no zero-sized array."""
    mesh = make_mesh({"seq": n, "fsdp": -1})
    q, k, v = qkv(np.random.default_rng(0), 1, 16 * n, 4, 2, 8)
    seg = jnp.zeros((1, 16 * n), jnp.int32)
    loss = lambda q, k, v: ring.ring_attention(q, k, v, seg, mesh=mesh).sum()  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert "tensor<0x" not in text


def test_ring_bad_length_is_a_clear_error():
    q, k, v = qkv(np.random.default_rng(0), 1, 12, 2, 2, 8)
    with pytest.raises(ValueError, match="divide by 2 x 4"):
        ring.ring_attention(q, k, v, None, mesh=make_mesh({"seq": 4, "fsdp": -1}))


@pytest.mark.slow
def test_ring_temp_memory_falls_with_shards():
    """Per-device temporary bytes of fwd+bwd at a fixed total length: what the shard holds
    (q, k, v, o, their gradients, the K/V and dK/dV in flight) scales as 1/n; the XLA tiles
    ([B, K, G, 64, 64] scores) are a constant on top, hence 0.4 rather than 0.25 for 2 -> 8."""
    B, T, N, K, H = 1, 4096, 4, 2, 32
    temp = {}
    for n in (2, 4, 8):
        mesh = make_mesh({"seq": n, "fsdp": -1})
        qspec, segspec = ring.attention_specs(mesh, B, N, K, "seq")
        arg = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
            shape, dtype, sharding=NamedSharding(mesh, spec))

        def f(q, k, v, seg):
            o, vjp = jax.vjp(lambda q, k, v: ring.ring_attention(
                q, k, v, seg, mesh=mesh, q_chunk=64, kv_chunk=64), q, k, v)
            return vjp(o)
        compiled = jax.jit(f).lower(
            arg((B, T, N, H), jnp.float32, qspec), arg((B, T, K, H), jnp.float32, qspec),
            arg((B, T, K, H), jnp.float32, qspec), arg((B, T), jnp.int32, segspec)).compile()
        temp[n] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[2] > temp[4] > temp[8], temp
    assert temp[8] < 0.4 * temp[2], temp


# ----------------------------------------------------------------------------- cuDNN plumbing

def fake_cudnn(monkeypatch):
    """cuDNN's padding-mask semantics emulated on XLA, with junk where cuDNN leaves values
    undefined (rows beyond q_len, keys beyond kv_len): checks everything around the kernel.
    Returns the list of (direction, causal, padded) calls made while tracing."""
    calls = []
    def masks(q, k, causal, q_len, kv_len):
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        rows, cols = jnp.arange(T)[None], jnp.arange(S)[None]
        q_seg = None if q_len is None else jnp.where(rows < q_len[:, None], 0, -1)
        kv_seg = None if kv_len is None else jnp.where(cols < kv_len[:, None], 0, -2)
        idx = (rows, cols) if causal else (None, None)
        return flash._as_masks(B, T, S, q_seg, kv_seg, *idx), rows, cols

    def packed(offsets_BM, lengths_BM, T):
        """[B, M, T, T'] one-hot: run m's position t is row token t'; and each run's stats
        slot: cuDNN numbers the runs of all rows one after another (as an H200 showed)."""
        B, M = lengths_BM.shape
        t = jnp.arange(T)
        src = offsets_BM[:, :M, None] + t                             # [B, M, T]
        ok = t[None, None] < lengths_BM[:, :, None]
        count_B = (lengths_BM > 0).sum(1)
        slot_BM = jnp.cumsum(count_B)[:, None] - count_B[:, None] + jnp.arange(M)
        slot_BM = jnp.where(jnp.arange(M) < count_B[:, None], slot_BM, B * M)  # unused: dropped
        return ((src[..., None] == t) & ok[..., None]).astype(jnp.float32), slot_BM

    def fwd(q, k, v, *, causal, scale, q_len=None, kv_len=None, q_off=None, kv_off=None):
        calls.append(("fwd", causal, q_len is not None))
        if q_off is not None:  # packed runs: ids from the offsets, stats per run
            B, T = q.shape[:2]
            onehot, slot_BM = packed(q_off, q_len, T)
            seg = jnp.einsum("bmts,m->bs", onehot, jnp.arange(q_len.shape[1]) + 1.0)
            m = flash._as_masks(B, T, T, seg, seg, jnp.arange(T), jnp.arange(T))
            o, lse = flash._flash_fwd(q, k, v, m, scale, 8, 8)
            stats_BMNT = jnp.einsum("bmts,bns->bmnt", onehot, lse)
            stats = jnp.full((slot_BM.size, *stats_BMNT.shape[2:]), 3.0)   # junk where unused
            return o.astype(q.dtype), stats.at[slot_BM].set(stats_BMNT, mode="drop")
        m, rows, _ = masks(q, k, causal, q_len, kv_len)
        o, lse = flash._flash_fwd(q, k, v, m, scale, 8, 8)
        if q_len is not None:
            ok = rows < q_len[:, None]
            o, lse = jnp.where(ok[:, :, None, None], o, 123.0), jnp.where(ok[:, None], lse, 7.0)
        return o.astype(q.dtype), lse

    def bwd(q, k, v, o, lse, do, *, causal, scale, q_len=None, kv_len=None, q_off=None,
            kv_off=None):
        calls.append(("bwd", causal, q_len is not None))
        if q_off is not None:
            B, T = q.shape[:2]
            onehot, slot_BM = packed(q_off, q_len, T)
            seg = jnp.einsum("bmts,m->bs", onehot, jnp.arange(q_len.shape[1]) + 1.0)
            m = flash._as_masks(B, T, T, seg, seg, jnp.arange(T), jnp.arange(T))
            lse_BMNT = lse.at[slot_BM].get(mode="fill", fill_value=0.0)
            lse = jnp.einsum("bmts,bmnt->bns", onehot, lse_BMNT)
            return flash._flash_bwd(q, k, v, o, lse, do, m, scale, 8, 8)
        m, rows, cols = masks(q, k, causal, q_len, kv_len)
        dq, dk, dv = flash._flash_bwd(q, k, v, o, lse, do, m, scale, 8, 8)
        if q_len is not None:
            dq = jnp.where((rows < q_len[:, None])[:, :, None, None], dq, 5.0)
            key_ok = (cols < kv_len[:, None])[:, :, None, None]
            dk, dv = jnp.where(key_ok, dk, 5.0), jnp.where(key_ok, dv, 5.0)
        return dq, dk, dv

    monkeypatch.setattr(flash.fc, "unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(flash.fc, "fwd", fwd)
    monkeypatch.setattr(flash.fc, "bwd", bwd)
    return calls


def test_ring_cudnn_plumbing_with_emulated_kernel(monkeypatch):
    """Segmented off-diagonal blocks go to cuDNN as a rectangle (rotated keys, padding
    lengths); segmented diagonal blocks as cuDNN's packed layout, whose per-run log-sum-exp
    the ring converts to and from per-token. Emulated here, exact in fp32."""
    calls = fake_cudnn(monkeypatch)
    ring_vs_dense(4, "zigzag", N=4, K=2, implementation="cudnn", seed=7)
    assert {("fwd", False, True), ("bwd", False, True), ("fwd", True, True),
            ("bwd", True, True)} == set(calls)


@pytest.mark.parametrize("kind", ["ring_block", "dense", "dense_packed"])
def test_cudnn_backward_binding_matches_jax_own_vjp(monkeypatch, kind):
    """Our direct bind of cuDNN's backward primitive has the operands and parameters that
    jax's own VJP uses (traced only, so it runs on CPU; catches jax version drift): the ring's
    blocks, and the dense kernel with named residuals, plain causal and packed segments."""
    cud = flash.fc._cudnn
    if cud is None or flash.fc._CUDNN_BWD is None:
        pytest.skip("no cuDNN attention module in this jax")
    monkeypatch.setattr(cud, "check_cudnn_version", lambda: 90800)
    if hasattr(cud, "check_compute_capability"):  # the packed layout asks for Hopper
        monkeypatch.setattr(cud, "check_compute_capability", lambda *a: True)
    q = jnp.zeros((1, 256, 8, 128), jnp.bfloat16)
    k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    seg = jnp.asarray(np.repeat([1, 2, 3], [100, 100, 56])[None], jnp.int32)
    packed = kind == "dense_packed"

    def theirs(q, k, v, do):
        if packed:
            offsets, lengths, _ = flash.fc.segment_runs(seg, 4)
            f = lambda q, k, v: cud.dot_product_attention(
                q, k, v, None, None, lengths, lengths, offsets, offsets, scale=0.1,
                mask_type=cud.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
        else:
            f = lambda q, k, v: cud.dot_product_attention(
                q, k, v, scale=0.1, mask_type=cud.MaskType.CAUSAL, qkv_layout="BTNH")
        return jax.vjp(f, q, k, v)[1](do)

    def ours(q, k, v, do):
        if kind == "ring_block":
            o, lse = flash.fc.fwd(q, k, v, causal=True, scale=0.1)
            return flash.fc.bwd(q, k, v, o, lse, do, causal=True, scale=0.1)
        f = lambda q, k, v: flash.fc.dense_causal(q, k, v, seg if packed else None, scale=0.1,
                                                  max_segments=4)
        return jax.vjp(f, q, k, v)[1](do)

    args = (q, k, k, q)
    assert cudnn_bwd_eqns(ours, *args) == cudnn_bwd_eqns(theirs, *args) != []


# ----------------------------------------------------------------------------- GPU only

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="cuDNN paths: run with JAX_PLATFORMS=cuda on a GPU")


@on_gpu
def test_gpu_cudnn_blocks_ring_and_dense_match_xla():
    """bf16 cuDNN against the XLA kernel (fp32 inputs of the same values)."""
    rng = np.random.default_rng(3)
    B, T, N, K, H = 2, 512, 8, 2, 128
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(rng, B, T, N, K, H))
    do = jnp.asarray(rng.normal(size=q.shape), jnp.bfloat16)
    seg = packed_segments(rng, B, T, 5)
    up = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
    assert flash.fc.unavailable_reason(q, k, need_bwd=True) is None

    def close(a, b, tol):
        assert rel_err(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)) < tol

    c = T // 2  # a "full" block with segments: queries = second half, keys = first half
    args = (q[:, c:], k[:, :c], v[:, :c])
    kw = dict(mask_kind="full", q_segment_ids=seg[:, c:], kv_segment_ids=seg[:, :c])
    causal_packed = dict(mask_kind="causal", q_segment_ids=seg, kv_segment_ids=seg)
    for kind_kw in (dict(mask_kind="causal"), causal_packed, kw):
        a3 = args if kind_kw is kw else (q, k, v)
        o_c, l_c = flash.block_attention(*a3, implementation="cudnn", **kind_kw)
        o_x, l_x = flash.block_attention(*up(*a3), implementation="xla", **kind_kw)
        close(o_c, o_x, 2e-2)
        fin = jnp.isfinite(l_x)
        np.testing.assert_array_equal(jnp.isfinite(l_c), fin)
        close(jnp.where(fin, l_c, 0), jnp.where(fin, l_x, 0), 1e-2)
        d = do[:, c:] if kind_kw is kw else do
        g_c = flash.block_attention_bwd(*a3, o_x.astype(jnp.bfloat16), l_x, d,
                                        implementation="cudnn", **kind_kw)
        g_x = flash.block_attention_bwd(*up(*a3), o_x, l_x, d.astype(jnp.float32),
                                        implementation="xla", **kind_kw)
        for gc, gx in zip(g_c, g_x):
            close(gc, gx, 5e-2)

    mesh = make_mesh({"seq": 1}, devices=jax.devices()[:1])
    # every GPU here: a ring of n > 1 has packed diagonal blocks and full off-diagonal ones
    mesh_n = make_mesh({"seq": -1})
    perm = ring.zigzag_permutation(T, mesh_n.shape["seq"])
    for fn in (lambda q, k, v, impl: ring.ring_attention(q, k, v, None, mesh=mesh,
                                                         implementation=impl),
               lambda q, k, v, impl: ring.ring_attention(q[:, perm], k[:, perm], v[:, perm],
                                                         seg[:, perm], mesh=mesh_n,
                                                         implementation=impl),
               lambda q, k, v, impl: flash.dense_attention(q, k, v, seg, implementation=impl)):
        o_c, vjp_c = jax.vjp(lambda q, k, v: fn(q, k, v, "cudnn"), q, k, v)
        o_x, vjp_x = jax.vjp(lambda q, k, v: fn(q, k, v, "xla"), *up(q, k, v))
        close(o_c, o_x, 2e-2)
        for gc, gx in zip(vjp_c(do), vjp_x(do.astype(jnp.float32))):
            close(gc, gx, 5e-2)
