"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Tokens arrive in natural order, T sharded over `seq`. One all-to-all per tensor turns
[B, T/n, N, H] into [B, T, N/n, H] (every device then holds whole sequences for a slice of
the heads), local causal packed attention runs through `flash.dense_attention`, and one
all-to-all turns the output back. As in verl and Long-RL, when there are fewer kv heads than
seq shards (K < n, n % K == 0) each kv head is repeated just enough for one per shard.
Gradients come from autodiff (an all-to-all transposes to the reverse all-to-all).

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from lrl.models import flash
from lrl.models.ring import attention_specs, shard_map


def kv_repeats(N: int, K: int, n: int) -> int:
    """How often each kv head is repeated so that n seq shards split the heads evenly
    (N and K per tensor shard); a ValueError naming the counts when impossible."""
    if N % n:
        raise ValueError(f"ulysses: {N} query heads (per tensor shard) do not divide by the "
                         f"seq axis size {n}")
    if K % n == 0:
        return 1
    if n % K == 0:
        return n // K
    raise ValueError(f"ulysses: {K} kv heads (per tensor shard) and seq axis size {n}: "
                     "one must divide the other")


def _local(q, k, v, seg, prefix=None, *, axis, n, repeats, implementation, chunks,
           max_segments):
    if repeats > 1:  # head j of the repeated K sits on shard j and serves its query heads
        k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    to_heads = functools.partial(lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1,
                                 tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)            # [B, T, N/n, H]
    seg = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
    if prefix is not None:   # whole rows on every device: the shared prompt as on one device
        from lrl.models.shared_attention import shared_attention
        prefix = lax.all_gather(prefix, axis, axis=1, tiled=True)
        o = shared_attention(q, k, v, seg, prefix, implementation=implementation,
                             max_segments=max_segments, q_chunk=chunks[0], kv_chunk=chunks[1])
    else:
        o = flash.dense_attention(q, k, v, seg, implementation=implementation,
                                  max_segments=max_segments, q_chunk=chunks[0],
                                  kv_chunk=chunks[1])
    return lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, mesh, seq_axis="seq",
                      implementation=None, max_segments=64, q_chunk=512, kv_chunk=512,
                      prefix_ids_BT=None):
    """Causal (packed) attention, natural token order, T sharded over `seq_axis` -> o_BTNH.
    segment_ids_BT may be None (one segment per row); max_segments bounds the segments of a
    whole row on cuDNN's packed path (see flash.dense_attention). `prefix_ids_BT` (with
    segment ids): the shared-prompt layout, attended as `shared_attention` does."""
    flash._check_qkv(q_BTNH, k_BSKH, v_BSKH)
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if k_BSKH.shape[1] != T:
        raise ValueError(f"ulysses_attention: q has T={T} positions, k has {k_BSKH.shape[1]}")
    qspec, segspec = attention_specs(mesh, B, N, K, seq_axis)
    n = mesh.shape[seq_axis]
    if T % n:
        raise ValueError(f"ulysses_attention: sequence length {T} must divide by seq axis "
                         f"size {n}")
    t = mesh.shape["tensor"] if qspec[2] is not None else 1
    local = functools.partial(_local, axis=seq_axis, n=n,
                              repeats=kv_repeats(N // t, K // t, n),
                              implementation=implementation, chunks=(int(q_chunk), int(kv_chunk)),
                              max_segments=int(max_segments))
    if segment_ids_BT is None:
        if prefix_ids_BT is not None:
            raise ValueError("ulysses_attention: prefix_ids need the segment ids they refer to")
        fn = shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh,
                       in_specs=(qspec, qspec, qspec), out_specs=qspec)
        return fn(q_BTNH, k_BSKH, v_BSKH)
    if prefix_ids_BT is None:
        fn = shard_map(local, mesh=mesh, in_specs=(qspec, qspec, qspec, segspec),
                       out_specs=qspec)
        return fn(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT.astype(jnp.int32))
    fn = shard_map(local, mesh=mesh, in_specs=(qspec, qspec, qspec, segspec, segspec),
                   out_specs=qspec)
    return fn(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT.astype(jnp.int32),
              prefix_ids_BT.astype(jnp.int32))
