"""Parameter trees: their logical axes, their shardings on a mesh, and sharded init.

The logical axes of each parameter follow from its name in the tree; `lrl.mesh.PARAM_RULES`
maps them to mesh axes. Shardings are derived from `jax.eval_shape(init)`, and `init_params`
creates every array directly in its sharding (never on one device and then resharded).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lrl import mesh as mesh_lib
from lrl.models.config import ModelConfig
from lrl.models.decoder import Decoder

# Leaf name (module/param) -> logical axes, without the leading "layers" axis of scanned blocks.
_AXES = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("lm_head",): ("embed", "vocab"),
    ("final_norm", "scale"): ("norm",),
    ("input_norm", "scale"): ("norm",),
    ("post_attn_norm", "scale"): ("norm",),
    ("q_norm", "scale"): ("head_dim",),
    ("k_norm", "scale"): ("head_dim",),
    ("q_proj", "kernel"): ("embed", "heads", "head_dim"),
    ("q_proj", "bias"): ("heads", "head_dim"),
    ("k_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("k_proj", "bias"): ("kv_heads", "head_dim"),
    ("v_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("v_proj", "bias"): ("kv_heads", "head_dim"),
    ("o_proj", "kernel"): ("heads", "head_dim", "embed"),
    ("o_proj", "bias"): ("norm",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("down_proj", "bias"): ("norm",),
}


def _axes_for(path, leaf) -> tuple:
    names = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)
    for n in (2, 1):
        if names[-n:] in _AXES:
            axes = _AXES[names[-n:]]
            if names[0] == "layers":  # scanned blocks carry a leading layer axis
                axes = ("layers",) + axes
            if len(axes) != leaf.ndim:
                raise ValueError(f"parameter {'/'.join(names)} has rank {leaf.ndim}, "
                                 f"expected axes {axes}")
            return axes
    raise ValueError(f"no logical axes known for parameter {'/'.join(names)}")


def logical_axes(params) -> Any:
    """A tree like `params` whose leaves are tuples of logical axis names."""
    return jax.tree_util.tree_map_with_path(_axes_for, params)


def abstract_params(cfg: ModelConfig):
    model = Decoder(cfg)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(lambda r, t: model.init(r, t, t, t)["params"],
                          jax.random.key(0), tokens)


def param_shardings(cfg: ModelConfig, mesh, shapes=None):
    shapes = abstract_params(cfg) if shapes is None else shapes
    rules = {**mesh_lib.PARAM_RULES, "embed": tuple(cfg.param_shard_axes)}
    return mesh_lib.param_shardings(mesh, shapes, logical_axes(shapes), rules)


def init_params(cfg: ModelConfig, rng, mesh=None):
    model = Decoder(cfg)

    def init(r):
        tokens = jnp.zeros((1, 8), jnp.int32)
        return model.init(r, tokens, tokens, tokens)["params"]

    if mesh is None:
        return jax.jit(init)(rng)
    return jax.jit(init, out_shardings=param_shardings(cfg, mesh))(rng)
