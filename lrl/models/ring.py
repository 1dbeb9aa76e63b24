"""Ring attention over the mesh's `seq` axis, written with `jax.shard_map`.

Each device holds one shard of the queries and, in turn, every shard of keys and values:
K and V (stacked into one buffer, so one transfer per hop) move one step around the ring
with `ppermute`, the transfer being issued before the local block is computed so that the two
overlap. Blocks are merged with an online softmax (float32 output and log-sum-exp). The
backward is a custom VJP: K and V go around the ring again together with their float32
gradient accumulators, and every block reuses the forward's final log-sum-exp. Grouped-query
attention never repeats K/V heads; segment ids of all shards are gathered once (4 bytes per
token instead of 4·K·H per hop) and indexed by the block's source shard.

Causal masking is by the global token index of the layout. "zigzag" splits a sequence into
2n chunks and gives shard i chunks i and 2n-1-i, so every shard does the same work: the
diagonal block is causal in local order; a block from an earlier shard j < i is seen only
through its first chunk (by all local queries); a block from a later shard j > i is seen only
by the second local chunk (all of it). "contiguous" (shard i holds chunk i) skips the blocks
of later shards and leaves the early shards idle: kept for comparison.

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lrl.models import flash

LAYOUTS = ("zigzag", "contiguous")


# ----------------------------------------------------------------------------- layouts

def zigzag_permutation(T: int, n: int) -> np.ndarray:
    """int32 [T]: `x[:, perm]` puts a naturally ordered sequence in the zigzag layout for n
    seq shards (2n chunks; shard i holds chunks i and 2n-1-i)."""
    if n < 1 or T % (2 * n):
        raise ValueError(f"zigzag layout: sequence length {T} must divide by 2 x {n} seq "
                         f"shards = {2 * n}")
    chunks = np.arange(T, dtype=np.int32).reshape(2 * n, T // (2 * n))
    order = [c for i in range(n) for c in (i, 2 * n - 1 - i)]
    return chunks[order].reshape(T)


def inverse_permutation(perm) -> np.ndarray:
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def layout_permutation(T: int, n: int, layout: str) -> np.ndarray:
    """The permutation of `layout` (identity for "contiguous", which needs T % n == 0)."""
    if layout == "zigzag":
        return zigzag_permutation(T, n)
    if layout == "contiguous":
        if T % n:
            raise ValueError(f"contiguous layout: sequence length {T} must divide by {n} shards")
        return np.arange(T, dtype=np.int32)
    raise ValueError(f"layout={layout!r}; choose one of {LAYOUTS}")


# ----------------------------------------------------------------------------- shard_map glue

def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` without the replication check (its name differs across versions);
    falls back to the experimental import path on older jax."""
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # pragma: no cover - jax < 0.7
        from jax.experimental.shard_map import shard_map as sm
    params = inspect.signature(sm).parameters
    extra = ({"check_vma": False} if "check_vma" in params
             else {"check_rep": False} if "check_rep" in params else {})
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **extra)


def attention_specs(mesh, B: int, N: int, K: int, seq_axis: str):
    """(spec of [B,T,N,H] and [B,S,K,H], spec of [B,T]): rows over data x fsdp, positions
    over `seq_axis`, heads over tensor, each only where the mesh axis divides the dimension."""
    if seq_axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {seq_axis!r}; its axes are {mesh.axis_names}")
    rows = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and mesh.shape[a] > 1)
    if rows and B % math.prod(mesh.shape[a] for a in rows):
        rows = ()  # rows replicated: correct, only redundant
    row = None if not rows else rows[0] if len(rows) == 1 else rows
    t = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
    heads = "tensor" if t > 1 and N % t == 0 and K % t == 0 else None
    return P(row, seq_axis, heads, None), P(row, seq_axis)


# ----------------------------------------------------------------------------- the ring

@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: str
    n: int
    layout: str
    scale: float
    implementation: str | None
    q_chunk: int
    kv_chunk: int
    max_segments: int

    # A block's masks are a tuple of id arrays for its queries and one for its keys: the
    # segment ids, and with a shared prompt the response x prefix ids of
    # `shared_attention.prefix_masks`. Each pair is one kernel call; their results merge.
    # The prefix pair runs on XLA: cuDNN's "full" block assumes the keys' last segment is the
    # only one shared with the queries, which holds for segments, not for prefixes. (Whole
    # rows on one device, `shared_attention`, give it to cuDNN as CrossRuns; a ring block's
    # runs would be one shard's part of each prefix and of its responses: not done yet.)

    def _impl(self, pair: int):
        return self.implementation if pair == 0 else "xla"

    def block(self, q, kv, qseg, kseg, kind):
        out = None
        for i, (qs, ks) in enumerate(zip(qseg, kseg)):
            blk = flash.block_attention(
                q, kv[0], kv[1], mask_kind=kind, q_segment_ids=qs, kv_segment_ids=ks,
                scale=self.scale, implementation=self._impl(i), out_dtype=jnp.float32,
                q_chunk=self.q_chunk, kv_chunk=self.kv_chunk, max_segments=self.max_segments)
            out = blk if out is None else _merge(*out, *blk)
        return out

    def block_bwd(self, q, kv, o, lse, do, qseg, kseg, kind):
        out = None
        for i, (qs, ks) in enumerate(zip(qseg, kseg)):
            g = flash.block_attention_bwd(
                q, kv[0], kv[1], o, lse, do, mask_kind=kind, q_segment_ids=qs,
                kv_segment_ids=ks, scale=self.scale, implementation=self._impl(i),
                q_chunk=self.q_chunk, kv_chunk=self.kv_chunk, max_segments=self.max_segments)
            out = g if out is None else tuple(a + b for a, b in zip(out, g))
        return out

    def send(self, x):
        return lax.ppermute(x, self.axis, [(j, (j + 1) % self.n) for j in range(self.n)])


_merge = flash.merge


def _seg_of(seg_all, src):
    """The masks of shard `src`'s keys, from every shard's gathered ones."""
    return tuple(None if x is None else lax.dynamic_index_in_dim(x, src, 0, keepdims=False)
                 for x in seg_all)


def _cols(segs, window):
    """Masks restricted to a window of positions."""
    return tuple(None if x is None else x[:, window] for x in segs)


def _fwd_off_diagonal(cfg, q, kv, seg, seg_all, acc, idx, src):
    """Merges the block of shard `src` (!= idx) into acc = (o, lse)."""
    kseg = _seg_of(seg_all, src)
    if cfg.layout == "contiguous":
        def earlier(acc):
            return _merge(*acc, *cfg.block(q, kv, seg, kseg, "full"))
        return lax.cond(src < idx, earlier, lambda acc: acc, acc)
    c = q.shape[1] // 2

    def earlier(acc):  # all local queries see the block's first chunk
        ks = _cols(kseg, slice(0, c))
        return _merge(*acc, *cfg.block(q, kv[:, :, :c], seg, ks, "full"))

    def later(acc):    # the second local chunk sees all of the block
        o, lse = acc
        qs = _cols(seg, slice(c, None))
        o2, lse2 = _merge(o[:, c:], lse[:, :, c:], *cfg.block(q[:, c:], kv, qs, kseg, "full"))
        return (lax.dynamic_update_slice_in_dim(o, o2, c, 1),
                lax.dynamic_update_slice_in_dim(lse, lse2, c, 2))
    return lax.cond(src < idx, earlier, later, acc)


def _add_window(acc, x, window, axis):
    """acc with x added to its static `window` along `axis`, by slice and update-slice.
    `acc.at[..., window].add(x)` would be a scatter whose full-window index is an empty
    constant; shard_map passes it in as an s32[0] operand, and XLA's GPU compiler segfaulted
    in its Shardy pass on that (jax 0.11.2, two H200s)."""
    start = window.start or 0
    if x.shape[axis] == acc.shape[axis]:
        return acc + x
    cur = lax.slice_in_dim(acc, start, start + x.shape[axis], axis=axis)
    return lax.dynamic_update_slice_in_dim(acc, cur + x, start, axis)


def _bwd_off_diagonal(cfg, q, kv, o, lse, do, seg, seg_all, dq, dkv, idx, src):
    """Adds the block of shard `src` (!= idx) to dq and to the block's own dk, dv."""
    kseg = _seg_of(seg_all, src)

    def grads(qsl, ksl, acc_dq, acc_dkv):
        qs, ks = _cols(seg, qsl), _cols(kseg, ksl)
        dq_b, dk_b, dv_b = cfg.block_bwd(q[:, qsl], kv[:, :, ksl], o[:, qsl], lse[:, :, qsl],
                                         do[:, qsl], qs, ks, "full")
        return (_add_window(acc_dq, dq_b, qsl, 1),
                _add_window(acc_dkv, jnp.stack([dk_b, dv_b]), ksl, 2))

    every = slice(None)
    if cfg.layout == "contiguous":
        return lax.cond(src < idx, lambda a: grads(every, every, *a), lambda a: a, (dq, dkv))
    c = q.shape[1] // 2
    return lax.cond(src < idx, lambda a: grads(every, slice(0, c), *a),
                    lambda a: grads(slice(c, None), every, *a), (dq, dkv))


def _gather_segments(cfg, kseg):
    return tuple(None if x is None else lax.all_gather(x, cfg.axis) for x in kseg)  # [n, B, S]


def _masks(seg, prefix):
    """(query masks, key masks) of the local shard: the segment ids (the same array on both
    sides, which is what lets cuDNN's packed layout run the diagonal block) and, with a
    shared prompt, the response x prefix ids."""
    if prefix is None:
        return (seg,), (seg,)
    from lrl.models.shared_attention import prefix_masks
    q_pre, kv_pre = prefix_masks(seg, prefix)
    return (seg, q_pre), (seg, kv_pre)


def _hops(hop, carry, n):
    """`hop` over the middle hops s = 1 .. n-2; with two shards there are none and no loop
    is built."""
    if n <= 2:
        return carry
    carry, _ = lax.scan(hop, carry, jnp.arange(1, n - 1))
    return carry


def _ring_forward(cfg, q, k, v, seg, prefix):
    idx = lax.axis_index(cfg.axis)
    seg, kseg = _masks(seg, prefix)
    if cfg.n == 1:  # no hops: nothing to stack or send
        return cfg.block(q, (k, v), seg, kseg, "causal")
    seg_all = _gather_segments(cfg, kseg)
    kv = jnp.stack([k, v])                                 # [2, B, S, K, H]: one buffer per hop
    kv_next = cfg.send(kv)                                 # in flight during the diagonal
    acc = cfg.block(q, kv, seg, kseg, "causal")

    def hop(carry, s):
        kv_cur, acc = carry
        kv_nxt = cfg.send(kv_cur)
        src = (idx - s) % cfg.n
        return (kv_nxt, _fwd_off_diagonal(cfg, q, kv_cur, seg, seg_all, acc, idx, src)), None

    kv_last, acc = _hops(hop, (kv_next, acc), cfg.n)
    return _fwd_off_diagonal(cfg, q, kv_last, seg, seg_all, acc, idx, (idx - cfg.n + 1) % cfg.n)


def _ring_backward(cfg, q, k, v, seg, prefix, o, lse, do):
    idx = lax.axis_index(cfg.axis)
    seg, kseg = _masks(seg, prefix)
    if cfg.n == 1:
        return cfg.block_bwd(q, (k, v), o, lse, do, seg, kseg, "causal")
    seg_all = _gather_segments(cfg, kseg)
    kv = jnp.stack([k, v])
    kv_next = cfg.send(kv)
    dq, dk, dv = cfg.block_bwd(q, kv, o, lse, do, seg, kseg, "causal")
    dkv_next = cfg.send(jnp.stack([dk, dv]))               # travels with its block

    def hop(carry, s):
        kv_cur, dkv_cur, dq = carry
        kv_nxt = cfg.send(kv_cur)
        src = (idx - s) % cfg.n
        dq, dkv_cur = _bwd_off_diagonal(cfg, q, kv_cur, o, lse, do, seg, seg_all, dq,
                                        dkv_cur, idx, src)
        return (kv_nxt, cfg.send(dkv_cur), dq), None

    kv_last, dkv_last, dq = _hops(hop, (kv_next, dkv_next, dq), cfg.n)
    dq, dkv_last = _bwd_off_diagonal(cfg, q, kv_last, o, lse, do, seg, seg_all, dq, dkv_last,
                                     idx, (idx - cfg.n + 1) % cfg.n)
    dkv = cfg.send(dkv_last)                               # one last hop brings it home
    return dq, dkv[0], dkv[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_local(cfg, q, k, v, seg, prefix):
    o, _ = _ring_forward(cfg, q, k, v, seg, prefix)
    return o.astype(q.dtype)


def _ring_local_fwd(cfg, q, k, v, seg, prefix):
    o, lse = _ring_forward(cfg, q, k, v, seg, prefix)
    o = checkpoint_name(o.astype(q.dtype), "attn_out")
    lse = checkpoint_name(lse, "attn_lse")  # a kept pair spares the backward a whole ring
    return o, (q, k, v, seg, prefix, o, lse)


def _ring_local_bwd(cfg, res, do):
    q, k, v, seg, prefix, o, lse = res
    dq, dk, dv = _ring_backward(cfg, q, k, v, seg, prefix, o, lse, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring_local.defvjp(_ring_local_fwd, _ring_local_bwd)


def ring_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, mesh, seq_axis="seq",
                   layout="zigzag", scale=None, implementation=None, q_chunk=512,
                   kv_chunk=512, prefix_ids_BT=None, max_segments=flash.MAX_SEGMENTS):
    """Causal (packed) attention with T sharded over `seq_axis` -> o_BTNH.

    Inputs and output are global arrays whose token order is already the layout's
    (`x[:, zigzag_permutation(T, n)]` for "zigzag"); segment_ids_BT may be None (one segment
    per row). `prefix_ids_BT` (with segment ids): the shared-prompt layout of
    `lrl.data.shared_prompt`, in the same token order; a response then also sees its
    prompt prefix, which may lie on other shards (every prefix key precedes its responses,
    so the ring's causal skipping of blocks still holds). `implementation`: None (cuDNN
    blocks on GPU when possible, else XLA), "xla" or "cudnn" (the ring's response x prefix
    blocks run on XLA whatever is chosen, unlike the dense path's, which `shared_attention`
    runs on cuDNN); q_chunk / kv_chunk size the XLA kernel's tiles; a row holds at most
    `max_segments` segments on cuDNN (NaN beyond).
    """
    flash._check_qkv(q_BTNH, k_BSKH, v_BSKH)
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if k_BSKH.shape[1] != T:
        raise ValueError(f"ring_attention: q has T={T} positions, k has {k_BSKH.shape[1]}")
    for name, x in (("segment_ids", segment_ids_BT), ("prefix_ids", prefix_ids_BT)):
        if x is not None and x.shape != (B, T):
            raise ValueError(f"ring_attention: {name} {x.shape} != {(B, T)}")
    if prefix_ids_BT is not None and segment_ids_BT is None:
        raise ValueError("ring_attention: prefix_ids need the segment ids they refer to")
    n = mesh.shape[seq_axis] if seq_axis in mesh.axis_names else 0
    layout_permutation(T, max(n, 1), layout)  # validates layout and divisibility
    qspec, segspec = attention_specs(mesh, B, N, K, seq_axis)
    cfg = _Ring(seq_axis, n, layout, float(H ** -0.5 if scale is None else scale),
                implementation, int(q_chunk), int(kv_chunk), int(max_segments))
    if segment_ids_BT is None:
        fn = shard_map(lambda q, k, v: _ring_local(cfg, q, k, v, None, None), mesh=mesh,
                       in_specs=(qspec, qspec, qspec), out_specs=qspec)
        return fn(q_BTNH, k_BSKH, v_BSKH)
    if prefix_ids_BT is None:
        fn = shard_map(lambda q, k, v, seg: _ring_local(cfg, q, k, v, seg, None), mesh=mesh,
                       in_specs=(qspec, qspec, qspec, segspec), out_specs=qspec)
        return fn(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT.astype(jnp.int32))
    fn = shard_map(functools.partial(_ring_local, cfg), mesh=mesh,
                   in_specs=(qspec, qspec, qspec, segspec, segspec), out_specs=qspec)
    return fn(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT.astype(jnp.int32),
              prefix_ids_BT.astype(jnp.int32))
