"""Ulysses attention (lrl.models.ulysses) against dense attention: values and gradients for
seq axis 2, 4 and 8, GQA with and without kv-head repetition, packed rows, tensor sharding;
clear errors when the heads do not divide.

B batch · T positions · N query heads · K kv heads · H head dim.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.mesh import make_mesh
from lrl.models import ulysses
from tests.test_ring import causal_reference, packed_segments, qkv, rel_err


@pytest.mark.parametrize("n,N,K,tensor,segmented", [
    (2, 4, 2, 1, True),    # K divides by n: no repetition
    (4, 4, 2, 1, True),    # K < n: each kv head repeated twice
    (8, 8, 2, 1, True),    # K < n: repeated four times
    (4, 4, 4, 1, False),   # N == K, one segment per row
    (2, 8, 4, 2, True),    # heads also sharded over tensor: N/t = 4, K/t = 2 per shard
])
def test_ulysses_matches_dense(n, N, K, tensor, segmented):
    rng = np.random.default_rng(n * 10 + K)
    B, T, H = 2, 32, 8
    q, k, v = qkv(rng, B, T, N, K, H)
    seg = packed_segments(rng, B, T, 3) if segmented else jnp.zeros((B, T), jnp.int32)
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    mesh = make_mesh({"seq": n, "tensor": tensor, "fsdp": -1})

    def with_grads(fn):
        def f(q, k, v):
            o, vjp = jax.vjp(fn, q, k, v)
            return o, vjp(do)
        return f
    ours = lambda q, k, v: ulysses.ulysses_attention(
        q, k, v, seg if segmented else None, mesh=mesh, q_chunk=8, kv_chunk=8)
    o, grads = jax.jit(with_grads(ours))(q, k, v)
    o_ref, grads_ref = with_grads(lambda q, k, v: causal_reference(q, k, v, seg))(q, k, v)
    assert rel_err(o, o_ref) < 1e-5
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-4, name


def test_kv_repeats():
    assert ulysses.kv_repeats(8, 4, 2) == 1
    assert ulysses.kv_repeats(8, 2, 4) == 2
    assert ulysses.kv_repeats(8, 1, 8) == 8


def test_heads_that_do_not_divide_are_clear_errors():
    q, k, v = qkv(np.random.default_rng(0), 1, 16, 6, 3, 8)
    mesh = make_mesh({"seq": 4, "fsdp": -1})
    with pytest.raises(ValueError, match="6 query heads .* seq axis size 4"):
        ulysses.ulysses_attention(q, k, v, None, mesh=mesh)
    q, k, v = qkv(np.random.default_rng(0), 1, 16, 12, 3, 8)
    with pytest.raises(ValueError, match="3 kv heads .* seq axis size 4"):
        ulysses.ulysses_attention(q, k, v, None, mesh=mesh)
