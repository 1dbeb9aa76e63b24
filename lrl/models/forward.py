"""The model's public functions: hidden states, logits and the unembedding matrix.

Inputs and outputs are in natural token order. With `cfg.attention == "ring"` on a mesh whose
`seq` axis is larger than one, tokens, positions and segment ids are permuted into the ring's
load-balanced (zig-zag) layout on the way in and the hidden states permuted back on the way
out, so callers never see the layout.

B batch · T positions · D model width · V vocabulary.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from lrl.models.config import ModelConfig
from lrl.models.decoder import Decoder, default_positions, logits_from_hidden


def ring_layout(cfg: ModelConfig, mesh, T: int):
    """(perm, inverse) when the ring runs sharded, else None."""
    if cfg.attention != "ring" or mesh is None or mesh.shape["seq"] == 1:
        return None
    from lrl.models import ring
    perm = ring.zigzag_permutation(T, mesh.shape["seq"])
    return jnp.asarray(perm), jnp.asarray(ring.inverse_permutation(perm))


def _devices(x) -> str:
    ids = sorted(d.id for d in x.sharding.device_set)
    return f"{len(ids)} device{'s' if len(ids) > 1 else ''} {ids if len(ids) <= 8 else ''}"


def check_mesh_inputs(params, arrays: dict, mesh) -> None:
    """Called eagerly, a forward on `mesh` needs its arrays on the mesh's devices and rows that
    data×fsdp divide; jax's own errors name neither argument nor remedy. Under jit (tracers)
    nothing is checked: jit places the arguments, and its partitioner pads uneven rows."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if any(isinstance(x, jax.core.Tracer) for x in [*(x for _, x in leaves), *arrays.values()]):
        return
    want = set(mesh.devices.flat)
    for path, x in leaves:
        if isinstance(x, jax.Array) and x.committed and x.sharding.device_set != want:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} lives on {_devices(x)}, not on the mesh's "
                f"{len(want)} devices: load the parameters onto the mesh with "
                "lrl.models.load_hf(path, mesh=mesh) (or jax.device_put(params, "
                "lrl.models.param_shardings(cfg, mesh)))")
    for name, x in arrays.items():
        if isinstance(x, jax.Array) and x.committed and x.sharding.device_set != want:
            raise ValueError(f"{name} lives on {_devices(x)}, not on the mesh's {len(want)} "
                             "devices: pass a host (numpy) array, or put it with "
                             "jax.device_put(x, lrl.mesh.batch_sharding(mesh))")
    rows = jnp.shape(arrays["tokens_BT"])[0]
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % n:
        raise ValueError(f"tokens_BT has {rows} rows, which the mesh's data×fsdp = {n} "
                         f"devices do not divide: pad the batch to a multiple of {n} rows (or "
                         "call forward inside jax.jit, whose partitioner pads them)")


def hidden_states(cfg: ModelConfig, params, tokens_BT, positions_BT=None,
                  segment_ids_BT=None, mesh=None, prefix_ids_BT=None):
    """Final-normalised hidden states [B, T, D] in the compute dtype. `prefix_ids_BT`: rows in
    the shared-prompt layout (`lrl.data.shared_prompt`), with their segment ids."""
    if prefix_ids_BT is not None and segment_ids_BT is None:
        raise ValueError("hidden_states: prefix_ids_BT (a shared prompt) needs segment_ids_BT")
    if mesh is not None:
        given = dict(tokens_BT=tokens_BT, positions_BT=positions_BT,
                     segment_ids_BT=segment_ids_BT, prefix_ids_BT=prefix_ids_BT)
        check_mesh_inputs(params, {k: v for k, v in given.items() if v is not None}, mesh)
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if positions_BT is None:
        positions_BT = default_positions(tokens_BT, segment_ids_BT)
    # segment_ids None means one sequence per row: plain causal attention, no mask work.
    layout = ring_layout(cfg, mesh, tokens_BT.shape[1])
    if layout is not None:
        perm, _ = layout
        tokens_BT, positions_BT = (jnp.take(a, perm, axis=1) for a in (tokens_BT, positions_BT))
        if segment_ids_BT is not None:
            segment_ids_BT = jnp.take(segment_ids_BT, perm, axis=1)
        if prefix_ids_BT is not None:
            prefix_ids_BT = jnp.take(prefix_ids_BT, perm, axis=1)
    x = Decoder(cfg, mesh).apply({"params": params}, tokens_BT, positions_BT, segment_ids_BT,
                                 prefix_ids_BT, method=Decoder.hidden)
    if layout is not None:
        x = jnp.take(x, layout[1], axis=1)
    return x


def batch_hidden_states(cfg: ModelConfig, params, batch, extra=None, mesh=None,
                        packed: bool = True):
    """`hidden_states` of a packed update batch (`lrl.rl.update`'s `hidden`): tokens,
    positions and, when `packed`, segment ids (unpacked rows are one sequence each, so
    attention needs no segment mask) and, when the batch has them, the shared-prompt
    layout's prefix ids. The text decoder reads nothing from `extra`."""
    del extra
    prefix = batch.get("prefix_ids")
    if prefix is not None and not packed:
        raise ValueError("update: a shared-prompt batch (prefix_ids) is packed; packed=False "
                         "means one sequence a row")
    return hidden_states(cfg, params, batch["tokens"], batch["positions"],
                         batch["segment_ids"] if packed else None, mesh, prefix)


def unembedding(cfg: ModelConfig, params):
    """The [D, V] output matrix (the embedding's transpose when tied)."""
    return params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]


def forward(cfg: ModelConfig, params, tokens_BT, positions_BT: Optional[jax.Array] = None,
            segment_ids_BT: Optional[jax.Array] = None, mesh=None):
    """float32 logits [B, T, V]. Materialises all logits: for long rows use
    `hidden_states` and the chunked log-probs of `lrl.rl`. With `mesh`, the parameters must
    live on its devices (`load_hf(path, mesh=mesh)`) and, called outside jit, B must be a
    multiple of data×fsdp; either is otherwise a ValueError naming the argument."""
    x = hidden_states(cfg, params, tokens_BT, positions_BT, segment_ids_BT, mesh)
    return logits_from_hidden(x, unembedding(cfg, params))
