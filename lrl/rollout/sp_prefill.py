"""Sequence-parallel prefill (MR-SP stage 2 for the rollout): a long prompt's per-layer K/V
computed by the training forward sharded over the mesh's `seq` axis (ring or Ulysses
attention), written straight into the engine's paged KV pool at the prefix's pages.

The engine's own prefill (`Engine.run_prefill`) runs a prompt on every device in full, in
chunks that attend to the pages already written: its cost per device grows with the prompt.
Here the prompt is split along T over `seq`: each layer's q, k, v come from the training
`Block.qkv`, attention is `lrl.models.attention.attend` (ring: zig-zag layout, K/V passed
around the ring; Ulysses: all-to-all to head shards), and k, v are scattered into the pool
(`paged_attention.write_kv`) at the pages and offsets of their natural token index, so the
layout never reaches the pool. Decoding then proceeds as usual: the pages hold exactly what
the engine's prefill would have written (the first T - 1 tokens; the last prompt token is fed
by the first decode step).

Prompts are given as the engine's `Prefix`es, text (token ids) or multimodal (input
embeddings [T, D] with the visual rows spliced in, and M-RoPE positions [3, T]), so video
prompts work. Prefixes are padded to a length bucket (a multiple of the ring's 2·seq chunks,
at most 1/8 above the prompt) and batched `data × fsdp` rows per call, rows split over those
axes. Padding tokens sit after the prompt (causal attention never lets a prompt token see
them) and write into the null page.

    prefill = sp_prefill.make_prefill(mesh)        # fn(engine, params, state, prefixes)
    state = prefill(engine, params, state, [engine.reserve_prefix(ids, embeds, pos)])

B batch rows · T query positions · D model width · Y pages per slot.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lrl import mesh as mesh_lib
from lrl.models.attention import attend
from lrl.models.decoder import constrain
from lrl.models.forward import ring_layout
from lrl.models.vl import constrain_positions
from lrl.rollout.engine import DecodeState, Engine, Prefix, embed_rows
from lrl.rollout.pages import NULL_PAGE, page_of
from lrl.rollout.steps import run_layers


def length_unit(attention: str, seq: int) -> int:
    """What a sharded prefill length must divide by: 2·seq chunks for the zig-zag ring,
    seq for Ulysses (and 1 without sequence parallelism)."""
    if seq == 1:
        return 1
    return 2 * seq if attention == "ring" else seq


def bucket_length(n: int, unit: int, minimum: int = 16) -> int:
    """A padded length >= n, a multiple of `unit`, at most 1/8 of the next power of two (rounded
    up to `unit`) above n: each octave of prompt lengths compiles at most 8 times."""
    n = max(int(n), minimum, 1)
    step = max(1, (1 << (n - 1).bit_length()) // 8)
    step = -(-step // unit) * unit
    return -(-n // step) * step


def prefill_rows(cfg, mesh, page_size, pool_sharding, params, k_pages, v_pages, tokens_BT,
                 n_valid_B, table_BY, embeds_BTD=None, positions_3BT=None):
    """Writes the K/V of tokens [0, n_valid) of each row into its pages (`table_BY`), every
    layer computed with `cfg.attention` over the mesh's seq axis. Multimodal rows pass their
    input embeddings and M-RoPE positions; text rows use the token embeddings and the token
    index as rotary position. Returns the new (k_pages, v_pages), in `pool_sharding`.
    Model code: `compiled_prefill` jits it."""
    B, T = tokens_BT.shape
    pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid_BT = pos_BT < n_valid_B[:, None]
    page_BT, offset_BT = page_of(table_BY, pos_BT, valid_BT, page_size)
    x = (jnp.take(params["embed"]["embedding"], tokens_BT, axis=0) if embeds_BTD is None
         else embeds_BTD).astype(cfg.dtype)
    rope = pos_BT if positions_3BT is None else positions_3BT
    layout = ring_layout(cfg, mesh, T)
    if layout is not None:  # the ring's zig-zag order; pages are addressed by natural index
        perm = layout[0]
        x, page_BT, offset_BT = (jnp.take(a, perm, axis=1) for a in (x, page_BT, offset_BT))
        rope = jnp.take(rope, perm, axis=rope.ndim - 1)
    rope = constrain_positions(rope, mesh)
    # Padding comes after the prompt, so plain causal attention over the whole row.
    _, k_pages, v_pages = run_layers(
        cfg, params, constrain(x, mesh), rope, k_pages, v_pages, page_BT, offset_BT,
        lambda q, k, v, kp, vp, base: attend(cfg, mesh, q, k, v, None),
        mesh=mesh, pool_sharding=pool_sharding)
    return k_pages, v_pages


@functools.lru_cache(maxsize=64)
def compiled_prefill(cfg, mesh, page_size: int, pool_sharding):
    """`prefill_rows` jitted once per (model, mesh, page size, pool sharding): the pool is
    donated and comes back in exactly the sharding it came in (so neither this function nor
    the engine's decode step compiles again for an equivalent but differently spelled
    sharding)."""
    fn = functools.partial(prefill_rows, cfg, mesh, page_size, pool_sharding)
    return jax.jit(fn, donate_argnums=(1, 2), out_shardings=(pool_sharding, pool_sharding))


def _call(engine: Engine, cfg, params, mesh, kp, vp, group: list[Prefix], rows: int, T: int):
    """One sharded prefill of up to `rows` prefixes padded to T tokens."""
    tokens = np.zeros((rows, T), np.int32)
    n_valid = np.zeros(rows, np.int32)
    table = np.full((rows, engine.ecfg.pages_per_slot), NULL_PAGE, np.int32)
    for r, pre in enumerate(group):
        n = pre.cached
        tokens[r, :n], n_valid[r], table[r] = pre.tokens[:n], n, engine.page_row(pre.pages)
    embeds = positions = None
    if group[0].embeds is not None:
        positions = np.zeros((3, rows, T), np.int32)
        for r, pre in enumerate(group):
            positions[:, r, :n_valid[r]] = pre.positions[:, :n_valid[r]]
        spec = mesh_lib.batch_spec(mesh, 2)
        embeds = jax.device_put(
            embed_rows(rows, T, cfg.d_model, cfg.dtype,
                       [(r, 0, pre.embeds, 0, int(n_valid[r])) for r, pre in enumerate(group)]),
            NamedSharding(mesh, P(*spec, None)))
        positions = jax.device_put(positions, NamedSharding(mesh, P(None, *spec)))
    tokens = jax.device_put(tokens, mesh_lib.batch_sharding(mesh, 2))
    fn = compiled_prefill(cfg, mesh, engine.ecfg.page_size, kp.sharding)
    return fn(params, kp, vp, tokens, n_valid, table, embeds, positions)


def prefill(engine: Engine, params, state: DecodeState, prefixes: Sequence[Prefix], *, mesh,
            min_tokens: int = 0, attention: Optional[str] = None) -> DecodeState:
    """`Engine.run_prefill` with the prefixes of at least `min_tokens` cached tokens prefilled
    sequence-parallel over `mesh` (the others go through the engine's own prefill).

    `attention` defaults to the engine's `cfg.attention`; "ring" or "ulysses" shard T over
    the seq axis, "dense" runs the same sharded forward with whole-sequence attention.
    `params` are the text decoder's (sharded as for training, or not)."""
    if mesh is None:
        raise ValueError("sp_prefill: a mesh is needed (its seq axis splits the prompt)")
    if engine.mesh is None or engine.mesh != mesh:
        raise ValueError("sp_prefill: the engine must be built on the same mesh (its pool is "
                         "laid out over that mesh's devices)")
    cfg = engine.cfg if attention is None else engine.cfg.replace(attention=attention)
    threshold = max(int(min_tokens), 1)
    short = [p for p in prefixes if p.cached < threshold]
    long = [p for p in prefixes if p.cached >= threshold]
    if short:
        state = engine.run_prefill(params, state, short)
    if not long:
        return state
    unit = length_unit(cfg.attention, mesh.shape["seq"])
    rows = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
    groups: dict[tuple[int, bool], list[Prefix]] = {}
    for pre in long:
        groups.setdefault((bucket_length(pre.cached, unit), pre.embeds is not None),
                          []).append(pre)
    kp, vp = state.k_pages, state.v_pages
    for (T, _), group in sorted(groups.items()):
        for i in range(0, len(group), rows):
            kp, vp = _call(engine, cfg, params, mesh, kp, vp, group[i:i + rows], rows, T)
    return state._replace(k_pages=kp, v_pages=vp)


def make_prefill(mesh, min_tokens: int = 0, attention: Optional[str] = None):
    """fn(engine, params, state, prefixes) -> state: `prefill` bound to a mesh, in the shape of
    `Engine.run_prefill` (with the engine first) for a rollout driver's prefill hook."""
    return functools.partial(prefill, mesh=mesh, min_tokens=min_tokens, attention=attention)
