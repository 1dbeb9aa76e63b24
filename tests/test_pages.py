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
    # Several queries per row (a prefill chunk at positions 6..11 over 12 keys), layer 0.
    q = jnp.asarray(rng.randn(2, 6, 4, 16), jnp.float32)
    q_pos = np.stack([np.arange(6, 12)] * 2).astype(np.int32)
    kv_len = np.array([12, 12], np.int32)
    want = _dense_reference(q, q_pos, kp, vp, table[:2], kv_len, 0)
    got = pa.paged_attention_xla(q, q_pos, kp, vp, table[:2], kv_len, 0, pages_per_block=4)
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


@pytest.mark.parametrize("kw", [dict(pallas_warps=3), dict(pallas_warps=0),
                                dict(pallas_stages=0)])
def test_engine_config_rejects_bad_pallas_launch_settings(kw):
    from lrl.rollout.steps import EngineConfig
    with pytest.raises(ValueError, match="pallas_warps must be a power of two"):
        EngineConfig(**kw)
