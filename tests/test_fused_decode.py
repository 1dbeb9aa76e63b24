"""The fused decode kernel (qkv bias, q/k norm, RoPE, page write and paged attention in one
Pallas program) against the unfused path, in interpret mode on CPU and lowered for CUDA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.models.config import tiny_config
from lrl.models.layers import RMSNorm, apply_rope, rope_angles
from lrl.rollout import paged_attention as pa
from lrl.rollout.pages import NULL_PAGE, page_of
from lrl.rollout.paged_kernel import fused_decode_attention


def _case(rng, N, K, H, bias, norm, dtype=jnp.float32, ps=4, M=8):
    B, L = 5, 2
    P = B * M + 1
    pool = lambda: jnp.asarray(rng.randn(K, L * P, ps, H), dtype)  # noqa: E731
    table = jnp.asarray((1 + rng.permutation(B * M)).reshape(B, M), jnp.int32)
    # cached tokens: 0 (a first token), mid-page, a page boundary, idle, nearly full
    lengths = jnp.asarray([0, ps + 2, 2 * ps, 0, ps * M - 2], jnp.int32)
    live = jnp.asarray([True, True, True, False, True])
    return dict(
        B=B, P=P, ps=ps, kp=pool(), vp=pool(), table=table, lengths=lengths, live=live,
        y=jnp.asarray(rng.randn(B, N + 2 * K, H), dtype),
        bias=jnp.asarray(rng.randn(N + 2 * K, H), dtype) if bias else None,
        qn=jnp.asarray(1 + 0.1 * rng.randn(H), dtype) if norm else None,
        kn=jnp.asarray(1 + 0.1 * rng.randn(H), dtype) if norm else None)


def _reference(c, N, K, H, layer_base, eps=1e-6):
    """Block.rotate's bias / norm / RoPE, write_kv and the XLA paged attention."""
    cfg = tiny_config(head_dim=H, n_heads=N, n_kv_heads=K)
    f32 = jnp.float32
    y = c["y"].astype(f32) + (c["bias"].astype(f32) if c["bias"] is not None else 0)
    y = y.astype(c["y"].dtype) if c["bias"] is None else y
    q, k, v = y[:, None, :N], y[:, None, N:N + K], y[:, None, N + K:]
    if c["qn"] is not None:
        norm = RMSNorm(eps=eps, dtype=c["y"].dtype, param_dtype=c["y"].dtype)
        q = norm.apply({"params": {"scale": c["qn"]}}, q)
        k = norm.apply({"params": {"scale": c["kn"]}}, k)
    cos, sin = rope_angles(cfg, c["lengths"][:, None])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dt = c["y"].dtype
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    page, offset = page_of(c["table"], c["lengths"][:, None], c["live"][:, None], c["ps"])
    kp, vp = pa.write_kv(c["kp"], c["vp"], k, v, page + layer_base, offset)
    kv_len = jnp.where(c["live"], c["lengths"] + 1, 0)
    out = pa.decode_attention(q, kp, vp, c["table"], kv_len, layer_base, impl="xla",
                              pages_per_block=2)
    return out[:, 0], kp, vp, (page[:, 0], offset[:, 0], kv_len, cos[:, 0], sin[:, 0])


@pytest.mark.parametrize("bias,norm,kv_per_program,k_splits", [
    (True, False, 1, 1), (False, True, 0, 1), (False, False, 1, 2), (True, False, 0, 4)])
def test_fused_kernel_matches_rotate_write_and_attend(bias, norm, kv_per_program, k_splits):
    """fp32, Qwen2-like (bias), Qwen3-like (q/k norm) and plain heads; one or both kv heads a
    program; one, two or four kv splits; rows at their first token, mid-page, at a page
    boundary, nearly full, and an idle row (zeros out, nothing written but the null page)."""
    rng = np.random.RandomState(0)
    N, K, H = 6, 2, 16
    c = _case(rng, N, K, H, bias, norm)
    base = c["P"]                                    # layer 1 of 2
    want_o, want_k, want_v, (page, offset, kv_len, cos, sin) = _reference(c, N, K, H, base)
    got_o, got_k, got_v = fused_decode_attention(
        c["y"], c["bias"], c["qn"], c["kn"], cos[:, :H // 2], sin[:, :H // 2], c["kp"], c["vp"],
        c["table"], kv_len, page, offset, base, n_heads=N, eps=1e-6, pages_per_block=2,
        k_splits=k_splits, kv_per_program=kv_per_program, interpret=True)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=2e-5, rtol=1e-5)
    assert not np.asarray(got_o[3]).any()            # the idle row
    null = base + NULL_PAGE                          # idle rows collide there, in any order
    for got, want, before in ((got_k, want_k, c["kp"]), (got_v, want_v, c["vp"])):
        got, want, before = (np.array(a) for a in (got, want, before))
        got[:, null], want[:, null], before[:, null] = 0, 0, 0
        np.testing.assert_allclose(got, want, atol=1e-6)
        changed = np.argwhere((got != before).any(axis=(0, 3)))
        assert len(changed) == 4                     # one slot for each live row


def test_fused_kernel_in_bf16_matches_unfused():
    """bf16, Qwen2.5-1.5B's group of 6 query heads a kv head, a bias: within bf16 rounding."""
    rng = np.random.RandomState(1)
    N, K, H = 12, 2, 32
    c = _case(rng, N, K, H, bias=True, norm=False, dtype=jnp.bfloat16)
    base = 0
    want_o, want_k, _, (page, offset, kv_len, cos, sin) = _reference(c, N, K, H, base)
    got_o, got_k, _ = fused_decode_attention(
        c["y"], c["bias"], None, None, cos[:, :H // 2], sin[:, :H // 2], c["kp"], c["vp"],
        c["table"], kv_len, page, offset, base, n_heads=N, eps=1e-6, pages_per_block=4,
        interpret=True)
    assert got_o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32),
                               atol=3e-2)
    live = np.asarray([0, 1, 2, 4])
    rows = np.asarray(page)[live] + base, np.asarray(offset)[live]
    np.testing.assert_array_equal(np.asarray(got_k, np.float32)[:, rows[0], rows[1]],
                                  np.asarray(want_k, np.float32)[:, rows[0], rows[1]])


def test_fused_kernel_lowers_to_triton():
    """Every variant's Pallas-to-Triton lowering runs on a CPU host (as for the plain kernel)."""
    S = jax.ShapeDtypeStruct
    bf, i32, f32 = jnp.bfloat16, jnp.int32, jnp.float32
    h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    B, N, K, H, M = 8, 12, 2, 128, 16
    pool = S((K, 2 * 64, 16, H), bf)
    for bias, norm, k_splits, kv_per_program in ((True, False, 1, 1), (False, True, 4, 0)):
        args = [S((B, N + 2 * K, H), bf), S((N + 2 * K, H), bf) if bias else None,
                S((H,), bf) if norm else None, S((H,), bf) if norm else None,
                S((B, H // 2), f32), S((B, H // 2), f32), pool, pool, S((B, M), i32),
                S((B,), i32), S((B,), i32), S((B,), i32)]
        f = jax.jit(lambda *a: fused_decode_attention(
            *a, 64, n_heads=N, eps=1e-6, pages_per_block=4, k_splits=k_splits,
            kv_per_program=kv_per_program))
        with jax.sharding.use_abstract_mesh(h200):
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "lrl_fused_decode" in text


def test_fused_kernel_rejects_bad_input():
    z = jnp.zeros
    kp = z((2, 9, 8, 16))
    common = (z((2, 8)), z((2, 8)), kp, kp, z((2, 4), jnp.int32), z((2,), jnp.int32),
              z((2,), jnp.int32), z((2,), jnp.int32), 0)
    with pytest.raises(ValueError, match="does not fit"):
        fused_decode_attention(z((2, 7, 16)), None, None, None, *common, n_heads=4, eps=1e-6,
                               pages_per_block=2, interpret=True)
    with pytest.raises(ValueError, match="both q and k norm"):
        fused_decode_attention(z((2, 8, 16)), None, z((16,)), None, *common, n_heads=4,
                               eps=1e-6, pages_per_block=2, interpret=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel")
@pytest.mark.parametrize("bias,norm,kv_per_program,k_splits", [
    (True, False, 1, 1), (True, False, 2, 1), (False, True, 1, 4)])
def test_gpu_fused_kernel_matches_unfused(bias, norm, kv_per_program, k_splits):
    """On a GPU: the compiled kernel, Qwen2.5-1.5B heads, pages of 16, bf16, against the
    unfused path; the new keys and values land where write_kv puts them."""
    rng = np.random.RandomState(3)
    N, K, H = 12, 2, 128
    c = _case(rng, N, K, H, bias, norm, dtype=jnp.bfloat16, ps=16, M=16)
    base = c["P"]
    want_o, want_k, want_v, (page, offset, kv_len, cos, sin) = _reference(c, N, K, H, base)
    got_o, got_k, got_v = fused_decode_attention(
        c["y"], c["bias"], c["qn"], c["kn"], cos[:, :H // 2], sin[:, :H // 2], c["kp"], c["vp"],
        c["table"], kv_len, page, offset, base, n_heads=N, eps=1e-6, pages_per_block=4,
        k_splits=k_splits, kv_per_program=kv_per_program)
    np.testing.assert_allclose(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32),
                               atol=3e-2)
    live = np.asarray([0, 1, 2, 4])
    at = np.asarray(page)[live] + base, np.asarray(offset)[live]
    for got, want in ((got_k, want_k), (got_v, want_v)):
        np.testing.assert_allclose(np.asarray(got, np.float32)[:, at[0], at[1]],
                                   np.asarray(want, np.float32)[:, at[0], at[1]], atol=2e-2)
