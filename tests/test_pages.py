"""Page pool bookkeeping, paged attention against a dense reference (XLA loop and the Pallas
GPU kernel in interpret mode), and the sampling filters against numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.rollout import paged_attention as pa
from lrl.rollout import pages as pages_lib
from lrl.rollout import sampling
from lrl.models.config import tiny_config


def test_pool_alloc_share_release():
    pool = pages_lib.PagePool(6)
    assert pool.capacity == 5 and pool.num_free == 5
    a = pool.alloc(3)
    assert pages_lib.NULL_PAGE not in a and len(set(a)) == 3 and pool.num_free == 2
    pool.share(a[:2])
    assert pool.refcount[a].tolist() == [2, 2, 1]
    assert pool.release(a) == [a[2]]            # only the unshared page comes back
    assert pool.num_free == 3 and not pool.all_free()
    assert sorted(pool.release(a[:2])) == sorted(a[:2])
    assert pool.all_free()
    with pytest.raises(ValueError, match="double free"):
        pool.release([a[0]])
    with pytest.raises(ValueError, match="not in use"):
        pool.share([a[0]])
    with pytest.raises(pages_lib.OutOfPages, match="asked for 6 pages, 5 of 5 free"):
        pool.alloc(6)
    with pytest.raises(ValueError, match="null page"):
        pages_lib.PagePool(1)


def test_pool_sizes():
    assert pages_lib.pages_for(0, 4) == 0 and pages_lib.pages_for(9, 4) == 3
    assert pages_lib.num_pages_for_tokens(16, 4) == 5
    cfg = tiny_config(n_layers=3, n_kv_heads=2, head_dim=8, dtype=jnp.bfloat16)
    assert pages_lib.kv_bytes_per_token(cfg) == 2 * 3 * 2 * 8 * 2
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="pool_tokens"):
            pages_lib.num_pages_for_memory(cfg, 16, 0.5)


def _random_pool(rng, K=2, L=2, P=24, ps=4, H=16):
    kp = jnp.asarray(rng.randn(K, L * P, ps, H), jnp.float32)
    vp = jnp.asarray(rng.randn(K, L * P, ps, H), jnp.float32)
    return kp, vp, P


def _dense_reference(q_BTNH, q_pos_BT, kp, vp, table, kv_len, base):
    """Gathers each row's pages into a dense cache and does causal softmax attention."""
    B, T, N, H = q_BTNH.shape
    K = kp.shape[0]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        n = int(kv_len[b])
        k = np.asarray(kp)[:, table[b] + base].reshape(K, -1, H)[:, :n]
        v = np.asarray(vp)[:, table[b] + base].reshape(K, -1, H)[:, :n]
        for t in range(T):
            seen = np.arange(n) <= q_pos_BT[b, t]
            if not seen.any():
                continue
            q = np.asarray(q_BTNH[b, t]).reshape(K, N // K, H)
            s = np.einsum("kgh,ksh->kgs", q, k[:, seen]) / np.sqrt(H)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[b, t] = np.einsum("kgs,ksh->kgh", w, v[:, seen]).reshape(N, H)
    return out


def test_paged_attention_matches_dense():
    rng = np.random.RandomState(0)
    kp, vp, P = _random_pool(rng)
    table = np.zeros((3, 8), np.int32)
    table[0, :3] = [3, 7, 1]
    table[1, :5] = [2, 4, 5, 6, 9]       # non-contiguous pages, partial last page
    table[2, :1] = [11]
    kv_len = np.array([10, 19, 0], np.int32)    # row 2 idle: must give zeros
    q = jnp.asarray(rng.randn(3, 1, 4, 16), jnp.float32)
    want = _dense_reference(q, kv_len[:, None] - 1, kp, vp, table, kv_len, P)
    got = pa.decode_attention(q, kp, vp, table, kv_len, P, impl="xla", pages_per_block=2)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The GPU kernel, run by the Pallas interpreter: same layout, scaling and masking.
    got = pa.decode_attention(q, kp, vp, table, kv_len, P, impl="pallas_interpret",
                              pages_per_block=2, k_splits=2)
    np.testing.assert_allclose(got, want, atol=1e-5)
    got = pa.decode_attention(q, kp, vp, table, kv_len, P, impl="pallas_interpret",
                              pages_per_block=2, k_splits=1, warps=4, stages=3)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for k_splits in (1, 2, 4):   # our kernel: unpadded q, in-kernel normalisation, splits
        got = pa.decode_attention(q, kp, vp, table, kv_len, P, impl="pallas_gqa_interpret",
                                  pages_per_block=2, k_splits=k_splits)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"k_splits={k_splits}")
    # Several queries per row (a prefill chunk at positions 6..11 over 12 keys), layer 0.
    q = jnp.asarray(rng.randn(2, 6, 4, 16), jnp.float32)
    q_pos = np.stack([np.arange(6, 12)] * 2).astype(np.int32)
    kv_len = np.array([12, 12], np.int32)
    want = _dense_reference(q, q_pos, kp, vp, table[:2], kv_len, 0)
    got = pa.paged_attention_xla(q, q_pos, kp, vp, table[:2], kv_len, 0, pages_per_block=4)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # Blocks past a row's keys are skipped (the second row holds 5 keys: its queries see at
    # most those, and one query sits before them all).
    q_pos = np.stack([np.arange(6, 12), np.arange(-1, 5)]).astype(np.int32)
    kv_len = np.array([12, 5], np.int32)
    want = _dense_reference(q, q_pos, kp, vp, table[:2], kv_len, 0)
    got = pa.paged_attention_xla(q, q_pos, kp, vp, table[:2], kv_len, 0, pages_per_block=2)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_write_kv_places_tokens():
    kp = jnp.zeros((2, 10, 4, 3))
    k = jnp.arange(2 * 3 * 2 * 3, dtype=jnp.float32).reshape(2, 3, 2, 3)    # [B,T,K,H]
    page = jnp.array([[5, 5, 6], [7, 0, 0]])
    off = jnp.array([[2, 3, 0], [1, 2, 3]])
    kp2, _ = pa.write_kv(kp, kp, k, k, page, off)
    np.testing.assert_array_equal(kp2[:, 5, 3], k[0, 1])
    np.testing.assert_array_equal(kp2[:, 6, 0], k[0, 2])
    np.testing.assert_array_equal(kp2[:, 7, 1], k[1, 0])
    assert float(jnp.abs(kp2[:, 1:5]).sum()) == 0.0


def _np_filtered_logp(logits, temperature, top_k, top_p):
    x = logits / temperature
    if top_k:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass_above = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[mass_above < top_p]] = True
    p = np.where(keep, p, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(p / p.sum())


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (6, 0.8)])
def test_sampling_filters_and_logps(top_k, top_p):
    rng = np.random.RandomState(1)
    logits = rng.randn(4, 32).astype(np.float32) * 2
    sp = sampling.SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    draw = jax.jit(lambda step: sampling.sample(jnp.asarray(logits), sampling.sample_keys(
        jax.random.key(0), jnp.arange(4), jnp.full(4, step)), sp))
    counts = np.zeros((4, 32))
    for step in range(40):
        tok, logp = draw(step)
        for b in range(4):
            want = _np_filtered_logp(logits[b], 0.8, top_k, top_p)
            assert np.isfinite(want[tok[b]]), "sampled a token outside the kept set"
            np.testing.assert_allclose(logp[b], want[tok[b]], atol=1e-5)
            counts[b, tok[b]] += 1
    assert (counts > 0).sum(axis=1).max() > 1    # it samples, not argmax
    greedy = sampling.SamplingParams()
    tok, logp = sampling.sample(jnp.asarray(logits), None, greedy)
    np.testing.assert_array_equal(tok, logits.argmax(-1))
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[np.arange(4), tok], atol=1e-6)
    with pytest.raises(ValueError, match="top_p"):
        sampling.SamplingParams(temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("block", [8, 37, 0])
def test_inverse_cdf_draw_follows_the_softmax(block):
    """20,000 draws from one row of 37 logits (blocks of 8 with padding, one block, and the
    automatic size) land on each token as often as its softmax probability says (within 5
    standard deviations), never on a -inf token, and report the token's log-softmax."""
    rng = np.random.RandomState(3)
    x = rng.randn(37).astype(np.float32) * 1.5
    x[[4, 20, 36]] = -np.inf
    n = 20000
    keys = sampling.sample_keys(jax.random.key(5), jnp.arange(n), jnp.zeros(n, jnp.int32))
    tok, logp = sampling.draw(jnp.asarray(np.tile(x, (n, 1))), keys, block=block)
    p = np.exp(x - x.max())
    p /= p.sum()
    freq = np.bincount(np.asarray(tok), minlength=37) / n
    assert freq[[4, 20, 36]].sum() == 0
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 1e-12)
    np.testing.assert_allclose(logp, np.log(p[np.asarray(tok)]), atol=1e-5)


def test_inverse_cdf_never_lands_on_a_token_without_mass():
    """Uniforms at 0, just under 1 and at every block boundary of a row whose blocks start and
    end with -inf tokens (as after a top-k cut) always give a kept token."""
    rng = np.random.RandomState(4)
    x = np.full(64, -np.inf, np.float32)
    keep = np.array([3, 4, 17, 30, 41, 42, 60])
    x[keep] = rng.randn(keep.size)
    p = np.exp(x - x.max())
    cum = np.cumsum(p.reshape(8, 8).sum(-1)) / p.sum()
    u = np.concatenate([[0.0, np.nextafter(np.float32(1), np.float32(0))], cum[:-1],
                        np.nextafter(cum[:-1].astype(np.float32), np.float32(0)),
                        rng.rand(200)]).astype(np.float32)
    tok, logp = sampling.invert_cdf(jnp.asarray(np.tile(x, (u.size, 1))), jnp.asarray(u), 8)
    assert set(np.asarray(tok).tolist()) <= set(keep.tolist())
    assert np.isfinite(np.asarray(logp)).all()


def test_inverse_cdf_block_sizes():
    assert sampling._block_size(151936) == 128          # Qwen2.5: 1,187 blocks, no padding
    assert sampling._block_size(128256) == 1002         # Llama 3
    assert sampling._block_size(50) == 50               # small vocabularies: one block
    assert sampling._block_size(100003) == 1024         # a prime: padded blocks


@pytest.mark.parametrize("kw", [dict(pallas_warps=3), dict(pallas_warps=0),
                                dict(pallas_stages=0)])
def test_engine_config_rejects_bad_pallas_launch_settings(kw):
    from lrl.rollout.steps import EngineConfig
    with pytest.raises(ValueError, match="pallas_warps must be a power of two"):
        EngineConfig(**kw)


@pytest.mark.parametrize("heads,kv_heads,kv_per_program", [
    (12, 2, 1), (12, 2, 0), (8, 8, 0), (8, 8, 2), (32, 1, 0)])
def test_gqa_kernel_in_bf16_matches_xla(heads, kv_heads, kv_per_program):
    """Our decode kernel in bf16 (the rollout's dtype) against the XLA path: GQA groups of 6
    (one or both kv heads per program), 1 (multi-head: 8 or 2 kv heads per program) and 32
    (more than one 16-row tile), a layer base, rows that end mid-page, one that is idle, and
    blocks of 2 pages of 8 tokens."""
    from lrl.rollout.paged_kernel import paged_decode_attention
    rng = np.random.RandomState(1)
    B, H, ps, M, L = 4, 32, 8, 8, 2
    P = B * M + 1
    pool = lambda: jnp.asarray(rng.randn(kv_heads, L * P, ps, H), jnp.bfloat16)  # noqa: E731
    kp, vp = pool(), pool()
    table = jnp.asarray((1 + rng.permutation(B * M)).reshape(B, M), jnp.int32)
    kv_len = jnp.asarray([1, 37, 0, 64], jnp.int32)
    q = jnp.asarray(rng.randn(B, 1, heads, H), jnp.bfloat16)
    want = pa.decode_attention(q, kp, vp, table, kv_len, P, impl="xla", pages_per_block=2)
    got = paged_decode_attention(q[:, 0], kp, vp, table, kv_len, P, pages_per_block=2,
                                 kv_per_program=kv_per_program, interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (B, heads, H)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want[:, 0], np.float32),
                               atol=2e-2)
    assert not np.asarray(got[2], np.float32).any()      # the idle row


def test_gqa_kernel_lowers_to_triton():
    """The kernel's Pallas-to-Triton lowering runs on a CPU host too (jax lowers for CUDA
    without a GPU), so a construct Triton cannot take fails here, not on the accelerator."""
    from lrl.rollout.paged_kernel import paged_decode_attention
    S = jax.ShapeDtypeStruct
    # jax 0.11 asks which GPU to lower for when none is attached.
    h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    for k_splits, kv_per_program in ((1, 1), (1, 0), (4, 0)):
        f = jax.jit(lambda q, k, v, t, n: paged_decode_attention(
            q, k, v, t, n, 3 * 50, pages_per_block=2, k_splits=k_splits,
            kv_per_program=kv_per_program))
        with jax.sharding.use_abstract_mesh(h200):
            lowered = f.trace(S((8, 12, 128), jnp.bfloat16), S((2, 200, 16, 128), jnp.bfloat16),
                              S((2, 200, 16, 128), jnp.bfloat16), S((8, 8), jnp.int32),
                              S((8,), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert "lrl_paged_decode" in lowered.as_text()


def test_gqa_kernel_rejects_bad_shapes():
    from lrl.rollout.paged_kernel import paged_decode_attention
    q = jnp.zeros((2, 4, 16), jnp.bfloat16)
    kp = jnp.zeros((2, 9, 8, 16), jnp.bfloat16)
    table, n = jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of k_splits"):
        paged_decode_attention(q, kp, kp, table, n, 0, pages_per_block=2, k_splits=4)
    with pytest.raises(ValueError, match="16 tokens"):   # checked for the GPU, not interpret
        paged_decode_attention(q, kp, kp, table, n, 0, pages_per_block=1)
    paged_decode_attention(q, kp, kp, table, n, 0, pages_per_block=1, interpret=True)
    with pytest.raises(ValueError, match="does not divide"):
        paged_decode_attention(q, kp, kp, table, n, 0, pages_per_block=2, kv_per_program=3)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q[:, :3], kp, kp, table, n, 0, pages_per_block=2)


def test_kv_heads_per_program_fill_one_tile():
    from lrl.rollout.paged_kernel import kv_heads_per_program
    got = {shape: kv_heads_per_program(*shape) for shape in
           [(12, 2), (28, 4), (8, 8), (32, 8), (32, 1), (40, 8)]}
    assert got == {(12, 2): 2, (28, 4): 2, (8, 8): 8, (32, 8): 4, (32, 1): 1, (40, 8): 2}


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel")
@pytest.mark.parametrize("kv_per_program,k_splits", [(1, 1), (2, 1), (1, 4)])
def test_gpu_gqa_kernel_matches_xla(kv_per_program, k_splits):
    """On a GPU: the compiled kernel, Qwen2.5-1.5B heads, pages of 16, bf16, against XLA."""
    from lrl.rollout.paged_kernel import paged_decode_attention
    rng = np.random.RandomState(2)
    B, N, K, H, ps, M, L = 8, 12, 2, 128, 16, 16, 2
    P = B * M + 1
    pool = lambda: jnp.asarray(rng.randn(K, L * P, ps, H), jnp.bfloat16)  # noqa: E731
    kp, vp = pool(), pool()
    table = jnp.asarray((1 + rng.permutation(B * M)).reshape(B, M), jnp.int32)
    kv_len = jnp.asarray([1, 16, 17, 100, 0, 255, 256, 31], jnp.int32)
    q = jnp.asarray(rng.randn(B, 1, N, H), jnp.bfloat16)
    want = pa.decode_attention(q, kp, vp, table, kv_len, P, impl="xla", pages_per_block=4)
    got = paged_decode_attention(q[:, 0], kp, vp, table, kv_len, P, pages_per_block=4,
                                 k_splits=k_splits, kv_per_program=kv_per_program)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want[:, 0], np.float32),
                               atol=2e-2)


def test_k_splits_fill_the_gpu_and_bound_a_long_row():
    """Splits fill the GPU at few slots and bound the tokens one program streams in a long
    row; short rows at many slots keep the splits they had."""
    from lrl.rollout.engine import k_splits
    assert k_splits(256, 1) == 2 and k_splits(256, 2) == 1 and k_splits(16, 1) == 16
    assert k_splits(256, 2, row_tokens=1279) == 1            # the short case: unchanged
    assert k_splits(128, 2, row_tokens=16639) == 16          # 16K rows: ~1K tokens a split
    assert k_splits(128, 2, row_tokens=2047) == 2            # the slot rule alone
    assert k_splits(8, 1, row_tokens=1 << 20) == 64          # capped at `most`
    for slots, rows in ((128, 16639), (256, 4095), (32, 70000)):
        k = k_splits(slots, 2, row_tokens=rows)
        assert k & (k - 1) == 0 and (rows // k < 2048 or k == 64)
