"""The weights laid out for decoding: the trainer's arrays, relaid once per rollout.

A decode step is bound by HBM bandwidth: every step reads every weight once. Three things in
the training layout cost bandwidth there, and this one copy per `generate` call removes them:
- layers are stacked [L, ...] for the scanned training model; slicing layer l out of the stack
  inside the step's loop copies it (a dynamic slice is materialised before its matmul), so
  each weight was read twice and written once per step. Here each layer is its own array.
- masters may be fp32; the step would read 4 bytes per weight and cast. Here they are in the
  compute dtype.
- with a mesh, FSDP shards would be all-gathered by every step. Here the `fsdp` and `data`
  shardings are dropped (each device holds what its `tensor` shard needs), one gather per
  rollout instead of one per token.
- gate_proj and up_proj are stacked into one [D, 2, F] weight (`gate_up`), one matmul.
- without tensor parallelism, q_proj, k_proj and v_proj are joined into one [D, N + 2K, H]
  weight (`qkv`), one matmul, for the reason gate and up are stacked. With `tensor` sharding
  the heads of the three are sharded separately, so they stay apart.
The copy costs one read of the weights and as many bytes of memory in the compute dtype.

L layers · D model width · F MLP width · N query heads · K key/value heads · H head dim ·
J joined projections (the 2 of gate_up, the N + 2K of qkv).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lrl import mesh as mesh_lib
from lrl.models import params as params_lib
from lrl.models.config import ModelConfig

# Decode keeps tensor parallelism only: every rule that names fsdp/data is dropped.
DECODE_RULES = {name: tuple(a for a in axes if a == "tensor")
                for name, axes in mesh_lib.PARAM_RULES.items()}


def is_decode_layout(params) -> bool:
    return isinstance(params.get("layers"), (tuple, list))


def _fuse_gate_up(layer, stack=None):
    """gate_proj and up_proj as one matmul, kernel [D, J, F] with J = 2 (bias [J, F]): one
    weight read at full bandwidth (XLA otherwise merges the two dots by concatenating the
    weights in every step). J sits before F so that sharding F over `tensor` keeps each
    shard's gate and up columns together. `stack` fuses the pair of leaves (arrays, or
    logical-axes tuples)."""
    if stack is None:
        stack = lambda g, u: jnp.stack([g, u], axis=-2)  # noqa: E731
    out = {k: v for k, v in layer.items() if k not in ("gate_proj", "up_proj")}
    out["gate_up"] = {k: stack(layer["gate_proj"][k], layer["up_proj"][k])
                      for k in layer["gate_proj"]}
    return out


def _fuse_qkv(layer, join=None):
    """q_proj, k_proj and v_proj as one projection, kernel [D, J, H] with J = N + 2K (bias
    [J, H]).
    `join` joins the three leaves (arrays, or logical-axes tuples)."""
    if join is None:
        join = lambda q, k, v: jnp.concatenate([q, k, v], axis=-2)  # noqa: E731
    names = ("q_proj", "k_proj", "v_proj")
    out = {k: v for k, v in layer.items() if k not in names}
    out["qkv"] = {k: join(*(layer[n][k] for n in names)) for k in layer["q_proj"]}
    return out


def _fuses_qkv(mesh) -> bool:
    return mesh is None or mesh.shape.get("tensor", 1) == 1


def _fuse(layer, mesh, stack=None, join=None):
    layer = _fuse_gate_up(layer, stack)
    return _fuse_qkv(layer, join) if _fuses_qkv(mesh) else layer


def _unstack(cfg: ModelConfig, params, mesh):
    cast = lambda a: a.astype(cfg.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
    out = {k: jax.tree.map(cast, v) for k, v in params.items() if k != "layers"}
    out["layers"] = tuple(_fuse(jax.tree.map(lambda a: cast(a[i]), params["layers"]), mesh)
                          for i in range(cfg.n_layers))
    return out


def _shardings(cfg: ModelConfig, params, mesh):
    axes = params_lib.logical_axes(params)
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(e, (str, type(None)))  # noqa: E731
                                                     for e in x)

    def spec(shape, logical):
        return jax.sharding.NamedSharding(mesh, mesh_lib.spec_for(logical, shape, mesh,
                                                                  DECODE_RULES))
    out = {k: jax.tree.map(lambda a, ax: spec(a.shape, ax), params[k], axes[k], is_leaf=is_axes)
           for k in params if k != "layers"}
    shapes = _fuse(jax.tree.map(lambda a: a.shape[1:], params["layers"]), mesh,
                   stack=lambda g, u: (*g[:-1], 2, g[-1]),
                   join=lambda q, k, v: (*q[:-2], q[-2] + k[-2] + v[-2], q[-1]))
    # Joined heads are only built without `tensor`, where no rule shards them anyway.
    logical = _fuse(jax.tree.map(lambda ax: ax[1:], axes["layers"], is_leaf=is_axes), mesh,
                    stack=lambda g, u: (*g[:-1], None, g[-1]),
                    join=lambda q, k, v: (*q[:-2], None, q[-1]))
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(e, int) for e in x)  # noqa: E731
    layer = jax.tree.map(spec, shapes, logical, is_leaf=is_shape)
    out["layers"] = (layer,) * cfg.n_layers
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def _to_decode(params, cfg: ModelConfig, mesh):
    out = _unstack(cfg, params, mesh)
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, _shardings(cfg, params, mesh))
    return out


def decode_params(cfg: ModelConfig, params, mesh=None):
    """Training-layout params -> decode layout (see the module docstring); a decode-layout
    tree is returned as it is."""
    if is_decode_layout(params):
        return params
    return _to_decode(params, cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnames=("old",))
def _refresh(old, params, cfg: ModelConfig, mesh):
    del old   # donated: the new layout is written into its buffers
    return _to_decode(params, cfg, mesh)


class DecodeWeights:
    """The policy in the decode layout, kept for a whole run: `refresh(params)` relays the
    training params into the same buffers (the previous copy is donated), so each step costs
    one read of the weights and no new allocation; unchanged params are not relaid.

    `keep=False` (where memory binds: the optimizer offloaded) gives the copy's memory to the
    update between rollouts: `release()` drops it and the next `refresh` lays it out anew (the
    same one read of the weights, in fresh buffers)."""

    def __init__(self, cfg: ModelConfig, mesh=None, keep: bool = True):
        self.cfg, self.mesh, self.keep = cfg, mesh, keep
        self.params = None
        self._source = None   # the training params the copy was made from

    def refresh(self, params):
        if params is self._source:
            return self.params
        if self.params is None:
            self.params = _to_decode(params, self.cfg, self.mesh)
            if self.keep:
                # Relaid a second time into its own buffers: the donating program compiles
                # now, with the engine, not in the first step that changes the params.
                self.params = _refresh(self.params, params, self.cfg, self.mesh)
        else:
            self.params = _refresh(self.params, params, self.cfg, self.mesh)
        self._source = params
        return self.params

    def release(self):
        """Without `keep`, drop the copy until the next `refresh` (a no-op with it)."""
        if not self.keep:
            self.params = self._source = None

    def device_bytes(self, device) -> int:
        """What the copy takes on `device` (0 when there is none)."""
        return sum(sh.data.nbytes for x in jax.tree.leaves(self.params)
                   for sh in x.addressable_shards if sh.device == device)
