"""Remat policies: every policy gives the same gradients, and the ones that keep the attention
kernel's named output and log-sum-exp run no attention forward a second time in the backward
(counted in the gradient's jaxpr), on the one-shard and the two-shard ring."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lrl.models as models
from lrl import mesh as mesh_lib
from lrl.models import flash
from tests.hf_util import rel_err

CFG = models.tiny_config(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                         mlp_dim=64, n_layers=2, attention="ring")


def _grad_fn(cfg, mesh):
    def f(params, tokens):
        logits = models.forward(cfg, params, tokens, mesh=mesh)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.grad(f)


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for x in (p if isinstance(p, (tuple, list)) else (p,)):
            inner = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
            if inner is not None:
                yield getattr(inner, "jaxpr", inner)


def _count_prims(jaxpr, name: str) -> int:
    """Equations of primitive `name`, nested programs included (each traced once)."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == name
        n += sum(_count_prims(j, name) for j in _sub_jaxprs(e))
    return n


@pytest.mark.parametrize("seq", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_attention_kept_by_dots_attn_and_save_attn(seq):
    mesh = mesh_lib.make_mesh({"seq": seq, "fsdp": 1}, devices=jax.devices()[:seq])
    params = models.init_params(CFG, jax.random.key(0))
    tokens = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 32))
    grads, counts = {}, {}
    for policy in ("none", "full", "dots_no_batch", "dots_attn", "save_attn"):
        cfg = CFG.replace(remat=policy)
        fn = _grad_fn(cfg, mesh)
        grads[policy] = jax.jit(fn)(params, tokens)
        counts[policy] = _count_prims(jax.make_jaxpr(fn)(params, tokens).jaxpr, "exp")
    for policy, g in grads.items():
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads["none"])):
            assert rel_err(a, b) < 1e-5, policy
    # exp is the softmax of the attention kernels (and of the loss): the forward kernel is
    # traced once for the primal, and again inside the rematerialised backward by policies
    # that do not keep the attention residuals.
    once = counts["none"]
    assert once > 0
    assert counts["dots_attn"] == counts["save_attn"] == once, counts
    assert counts["full"] > once and counts["dots_no_batch"] > once, counts


def test_named_residuals_are_what_dots_attn_saves(capsys):
    """What the policy keeps per layer: the matmul outputs plus attention's out and lse."""
    from lrl.models.layers import remat_policy
    q = jnp.ones((1, 16, 4, 8))
    k = v = jnp.ones((1, 16, 2, 8))

    def f(q, k, v):
        o = flash.dense_attention(q, k, v, None, implementation="xla", q_chunk=8, kv_chunk=8)
        return jnp.sum(o @ jnp.ones((8, 8)))
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(f, policy=remat_policy("dots_attn")), q, k, v)
    saved = capsys.readouterr().out
    assert "named 'attn_out'" in saved and "named 'attn_lse'" in saved, saved
