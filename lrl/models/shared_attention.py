"""Attention over rows in the shared-prompt layout (`lrl.data.shared_prompt`): a group's
prompt prefix once, then its responses, each response seeing itself causally and the prefix
fully, never the other responses.

It is two blocks merged by their log-sum-exp (`flash.merge`, as the ring merges its blocks):

  self    query and key in the same segment, key not after query: every token's causal
          attention within its own segment (a prefix's, a response's, an unshared
          sequence's), `flash.block_attention(mask_kind="causal")` with the segment ids:
          cuDNN's packed layout on GPU, the XLA kernel elsewhere.
  prefix  a response's query and its prefix's keys. Ids from `prefix_masks` match exactly
          those pairs; the causal index is kept too (every prefix key precedes its responses),
          which lets the XLA kernel skip the chunk pairs above the diagonal and those of
          rows' other groups. The XLA kernel runs it on every backend: cuDNN's padded forms
          in lrl (`flash.block_attention`) take one rectangle or one set of runs for queries
          and keys alike, and a row of several groups needs a run of responses against a
          run of prefix keys per group.

The backward hands each block the merged output and log-sum-exp, as flash-attention's
backward does, so the two blocks' gradients add up; a prefix's keys and values collect the
gradient of every response that reads them.

`shared_attention` is the whole row on one device (the model's "dense" path, and each head
slice under Ulysses); `lrl.models.ring` runs the same two blocks per ring step over `seq`.

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lrl.models import flash

_NO_QUERY, _NO_KEY = -1, -2   # ids that match nothing on the other side


def prefix_masks(segment_ids_BT, prefix_ids_BT):
    """(query ids, key ids) [B, T] of the prefix block: a response token's query carries its
    prefix's segment id, a prefix token's key its own; every other query and key carries an
    id that matches nothing."""
    seg = jnp.asarray(segment_ids_BT, jnp.int32)
    pre = jnp.asarray(prefix_ids_BT, jnp.int32)
    response = (pre > 0) & (pre != seg)
    prefix = (pre > 0) & (pre == seg)
    return jnp.where(response, pre, _NO_QUERY), jnp.where(prefix, pre, _NO_KEY)


@dataclasses.dataclass(frozen=True)
class _Opts:
    scale: float
    implementation: str | None
    q_chunk: int
    kv_chunk: int
    max_segments: int


def _blocks(o: _Opts, seg, pre):
    """The two blocks as (query ids, key ids, implementation); the self block passes the
    same array twice, which is what lets `block_attention` take cuDNN's packed layout."""
    q_pre, kv_pre = prefix_masks(seg, pre)
    return ((seg, seg, o.implementation), (q_pre, kv_pre, "xla"))


def _forward(o: _Opts, q, k, v, seg, pre):
    out = None
    for qs, ks, impl in _blocks(o, seg, pre):
        blk = flash.block_attention(q, k, v, mask_kind="causal", q_segment_ids=qs,
                                    kv_segment_ids=ks, scale=o.scale, implementation=impl,
                                    out_dtype=jnp.float32, q_chunk=o.q_chunk,
                                    kv_chunk=o.kv_chunk, max_segments=o.max_segments)
        out = blk if out is None else flash.merge(*out, *blk)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _shared(o: _Opts, q, k, v, seg, pre):
    return _forward(o, q, k, v, seg, pre)[0].astype(q.dtype)


def _shared_fwd(o: _Opts, q, k, v, seg, pre):
    out, lse = _forward(o, q, k, v, seg, pre)
    # Named as the other kernels name theirs, so the remat policies treat them alike.
    out = checkpoint_name(out.astype(q.dtype), "attn_out")
    lse = checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, seg, pre, out, lse)


def _shared_bwd(o: _Opts, res, do):
    q, k, v, seg, pre, out, lse = res
    grads = None
    for qs, ks, impl in _blocks(o, seg, pre):
        g = flash.block_attention_bwd(q, k, v, out, lse, do, mask_kind="causal",
                                      q_segment_ids=qs, kv_segment_ids=ks, scale=o.scale,
                                      implementation=impl, q_chunk=o.q_chunk,
                                      kv_chunk=o.kv_chunk, max_segments=o.max_segments)
        grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
    dq, dk, dv = grads
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_shared.defvjp(_shared_fwd, _shared_bwd)


def shared_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, prefix_ids_BT, *,
                     implementation=None, scale=None, max_segments=flash.MAX_SEGMENTS,
                     q_chunk=512, kv_chunk=512):
    """Causal attention within segments plus each response's view of its shared prefix
    (module docstring) over whole rows -> o_BTNH in q's dtype. `implementation` (None, "xla"
    or "cudnn") picks the self block's kernel as `flash.dense_attention` does; with
    `prefix_ids_BT` all 0 the result is `flash.dense_attention`'s."""
    flash._check_qkv(q_BTNH, k_BSKH, v_BSKH)
    B, T, _, H = q_BTNH.shape
    if k_BSKH.shape[1] != T:
        raise ValueError(f"shared_attention: q has T={T}, k has S={k_BSKH.shape[1]}")
    for name, x in (("segment_ids", segment_ids_BT), ("prefix_ids", prefix_ids_BT)):
        if x is None or x.shape != (B, T):
            raise ValueError(f"shared_attention: {name} must be [B, T] = {(B, T)}, got "
                             f"{None if x is None else x.shape}")
    o = _Opts(float(H ** -0.5 if scale is None else scale), implementation, int(q_chunk),
              int(kv_chunk), int(max_segments))
    return _shared(o, q_BTNH, k_BSKH, v_BSKH, jnp.asarray(segment_ids_BT, jnp.int32),
                   jnp.asarray(prefix_ids_BT, jnp.int32))
