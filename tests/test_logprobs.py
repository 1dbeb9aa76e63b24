"""Chunked token log-probs and entropy against the dense computation; memory stays chunked."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.rl.logprobs import token_logprobs_and_entropy


def _dense(h_BTD, w_DV, targets_BT):
    logits = jnp.einsum("btd,dv->btv", h_BTD, w_DV).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    ent_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logp_BT, ent_BT


def _case(b, t, d, v, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k1, (b, t, d), jnp.float32)
    w = jax.random.normal(k2, (d, v), jnp.float32) * 0.5
    tgt = jax.random.randint(k3, (b, t), 0, v)
    return h, w, tgt


@pytest.mark.parametrize("t,chunk", [(16, 4), (13, 4), (7, 64)])
def test_values_and_gradients_match_dense(t, chunk):
    h, w, tgt = _case(2, t, 8, 37)
    logp, ent = token_logprobs_and_entropy(h, w, tgt, chunk=chunk)
    ref_logp, ref_ent = _dense(h, w, tgt)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)
    # Random cotangents on both outputs exercise both terms of d(logits).
    ca, cb = jax.random.normal(jax.random.key(1), (2, 2, t))

    def obj(fn):
        return lambda h, w: jnp.sum(ca * fn(h, w)[0]) + jnp.sum(cb * fn(h, w)[1])

    g = jax.grad(obj(lambda h, w: token_logprobs_and_entropy(h, w, tgt, chunk=chunk)),
                 argnums=(0, 1))(h, w)
    g_ref = jax.grad(obj(lambda h, w: _dense(h, w, tgt)), argnums=(0, 1))(h, w)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)


def test_without_entropy_gradient_is_logp_only():
    h, w, tgt = _case(1, 8, 4, 11, seed=3)
    logp, ent = token_logprobs_and_entropy(h, w, tgt, chunk=3, compute_entropy=False)
    assert float(jnp.abs(ent).max()) == 0.0
    g = jax.grad(lambda h: token_logprobs_and_entropy(h, w, tgt, chunk=3,
                                                      compute_entropy=False)[0].sum())(h)
    np.testing.assert_allclose(g, jax.grad(lambda h: _dense(h, w, tgt)[0].sum())(h),
                               rtol=1e-4, atol=1e-6)


def test_bf16_compute_fp32_out():
    h, w, tgt = _case(2, 8, 16, 32, seed=5)
    logp, ent = token_logprobs_and_entropy(h.astype(jnp.bfloat16), w, tgt, chunk=4)
    ref_logp, ref_ent = _dense(h, w, tgt)
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, ref_logp, atol=0.1)
    np.testing.assert_allclose(ent, ref_ent, atol=0.1)
    gw = jax.grad(lambda w: token_logprobs_and_entropy(
        h.astype(jnp.bfloat16), w, tgt, chunk=4)[0].sum())(w)
    assert gw.dtype == jnp.float32  # the cast's transpose brings the gradient back to fp32


def test_logits_never_exist_whole():
    # T·V·4 = 8192 · 4096 · 4 = 128 MiB; one chunk of logits is 512 · 4096 · 4 = 8 MiB.
    b, t, d, v, chunk = 1, 8192, 32, 4096, 512
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    tgt = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(h, w, tgt):
        logp, ent = token_logprobs_and_entropy(h, w, tgt, chunk=chunk)
        return jnp.sum(logp) + 0.1 * jnp.sum(ent)

    full = t * v * 4
    fwd = jax.jit(loss).lower(h, w, tgt).compile().memory_analysis()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w, tgt).compile().memory_analysis()
    for name, m in (("forward", fwd), ("backward", bwd)):
        assert m.temp_size_in_bytes < full / 4, (name, m.temp_size_in_bytes, full)


def test_bad_inputs():
    h, w, tgt = _case(1, 4, 4, 5)
    with pytest.raises(ValueError, match="matching D"):
        token_logprobs_and_entropy(h, w.T, tgt)
    with pytest.raises(ValueError, match="targets_BT has shape"):
        token_logprobs_and_entropy(h, w, tgt[:, :3])
    with pytest.raises(ValueError, match="integer ids"):
        token_logprobs_and_entropy(h, w, tgt.astype(jnp.float32))
