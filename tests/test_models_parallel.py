"""A whole model with ring / Ulysses attention over the `seq` axis equals the dense model:
logits and the gradients of every parameter, in natural token order, packed rows included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lrl.models as models
from lrl import mesh as mesh_lib
from tests.hf_util import rel_err

CFG = models.tiny_config(model_type="qwen3", qk_norm=True, vocab_size=96, d_model=32,
                         n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, n_layers=2)


def _inputs(T=32, B=2):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, CFG.vocab_size, (B, T))
    # Segments that do not align with shard boundaries.
    seg = np.concatenate([np.full(11, 1), np.full(T - 11 - 3, 2), np.zeros(3, int)])
    return tokens, np.stack([seg, np.ones(T, int)])


def _loss(cfg, mesh):
    def f(params, tokens, seg):
        logits = models.forward(cfg, params, tokens, segment_ids_BT=seg, mesh=mesh)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (seg > 0)), logits
    return jax.jit(jax.value_and_grad(f, has_aux=True))


@pytest.mark.parametrize("attention,seq", [("ring", 2), pytest.param("ring", 4, marks=pytest.mark.slow),
                                           ("ulysses", 2)])
def test_sequence_parallel_model_equals_dense(attention, seq):
    params = models.init_params(CFG, jax.random.key(1))
    tokens, seg = _inputs()
    (_, want_logits), want_grads = _loss(CFG, None)(params, tokens, seg)
    mesh = mesh_lib.make_mesh({"seq": seq, "fsdp": -1})
    cfg = CFG.replace(attention=attention)
    sharded = jax.device_put(params, models.param_shardings(cfg, mesh))
    (_, logits), grads = _loss(cfg, mesh)(sharded, tokens, seg)
    assert rel_err(logits, want_logits) < 1e-5
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        want = jax.tree_util.tree_flatten_with_path(want_grads)[0]
        w = dict((jax.tree_util.keystr(p), x) for p, x in want)[jax.tree_util.keystr(path)]
        assert rel_err(g, w) < 1e-4, jax.tree_util.keystr(path)
