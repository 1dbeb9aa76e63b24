"""Attention over rows in the shared-prompt layout (`lrl.data.shared_prompt`): a group's
prompt prefix once, then its responses, each response seeing itself causally and the prefix
fully, never the other responses.

It is two blocks merged by their log-sum-exp (`flash.merge`, as the ring merges its blocks):

  self    query and key in the same segment, key not after query: every token's causal
          attention within its own segment (a prefix's, a response's, an unshared
          sequence's), `flash.block_attention(mask_kind="causal")` with the segment ids:
          cuDNN's packed layout on GPU, the XLA kernel elsewhere.
  prefix  a response's query and its prefix's keys (`prefix_masks`' ids match exactly those
          pairs). On GPU: cuDNN's packed layout with distinct query and key runs
          (`flash_cudnn.CrossRuns`): run e of a row is one group, its responses (contiguous,
          right after the prefix, as `lrl.data.shared_prompt` packs them) against its
          prefix's keys, mask PADDING (every prefix key precedes its responses); what cuDNN
          leaves undefined (prefix tokens' and unshared sequences' queries, keys no run
          reads) is masked to o = 0, lse = -inf and zero gradients. Elsewhere, or with
          implementation="xla": the blockwise XLA kernel, with the causal index kept too,
          which lets it skip the chunk pairs above the diagonal and those of rows' other
          groups. Both blocks take one kernel, chosen as `flash.block_attention` chooses.

The backward hands each block the merged output and log-sum-exp, as flash-attention's
backward does, so the two blocks' gradients add up; a prefix's keys and values collect the
gradient of every response that reads them.

`shared_attention` is the whole row on one device (the model's "dense" path, and each head
slice under Ulysses); `lrl.models.ring` runs the same two blocks per ring step over `seq`,
its prefix blocks on XLA on every backend (a ring block's keys are one shard's, whose
prefix runs are not yet given to cuDNN).

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lrl.models import flash
from lrl.models import flash_cudnn as fc

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

    @property
    def prefix_runs(self) -> int:
        """Runs (groups) a row may hold in the prefix block's cuDNN call: a shared group
        takes three segments at least (its prefix and two responses), so a row of more
        groups has more than `max_segments` segments, which the self block's cuDNN call
        gives as NaN already."""
        return max(2, self.max_segments // 3)


def kernel(q_BTNH, k_BSKH, implementation=None) -> str:
    """The kernel ("cudnn" or "xla") both blocks take for these dtypes and shapes (arrays or
    ShapeDtypeStructs), chosen as `flash.block_attention` chooses: cuDNN where it can run
    forward and backward here and the caller did not ask for "xla"."""
    return flash._pick(implementation, q_BTNH, k_BSKH, need_bwd=True, where="shared_attention")


def _self_kw(o: _Opts, impl, seg):
    # The same array for queries and keys: what lets `block_attention` take cuDNN's packed
    # layout.
    return dict(mask_kind="causal", q_segment_ids=seg, kv_segment_ids=seg, scale=o.scale,
                implementation=impl, q_chunk=o.q_chunk, kv_chunk=o.kv_chunk,
                max_segments=o.max_segments)


def _prefix_xla_kw(o: _Opts, seg, pre):
    q_pre, kv_pre = prefix_masks(seg, pre)
    return dict(mask_kind="causal", q_segment_ids=q_pre, kv_segment_ids=kv_pre,
                scale=o.scale, implementation="xla", q_chunk=o.q_chunk, kv_chunk=o.kv_chunk)


def prefix_runs(segment_ids_BT, prefix_ids_BT, max_runs) -> fc.CrossRuns:
    """The prefix block as cuDNN's runs: query run e = the responses of one group of the
    row, key run e = its prefix, matched by the prefix's id."""
    return fc.CrossRuns.of(*prefix_masks(segment_ids_BT, prefix_ids_BT), max_runs)


def _prefix_cudnn(o: _Opts, q, k, v, runs: fc.CrossRuns):
    """The prefix block's forward on cuDNN -> (o float32, lse); rows of no shared group
    (a micro-batch of unshared sequences) skip the kernel."""
    def call():
        out, stats = fc.fwd(q, k, v, causal=False, scale=o.scale, **runs.kwargs)
        return runs.outputs(out, stats)

    def empty():
        B, T, N, H = q.shape
        return jnp.zeros((B, T, N, H), jnp.float32), jnp.full((B, N, T), -jnp.inf)
    return lax.cond(runs.any_run, call, empty)


def _prefix_cudnn_bwd(o: _Opts, q, k, v, out, lse, do, runs: fc.CrossRuns):
    """Its backward given the merged output and log-sum-exp: cuDNN's dq of a run is
    sum over its keys of P (dP - D) with D = rowsum(dO . O) of the merged O, which is the
    prefix block's share of the merged attention's dq (as for a ring's blocks)."""
    def call():
        g = fc.bwd(q, k, v, out, runs.stats_of(lse), do, causal=False, scale=o.scale,
                   **runs.kwargs)
        return runs.grads(*g)

    def empty():
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    return lax.cond(runs.any_run, call, empty)


def _forward(o: _Opts, q, k, v, seg, pre):
    impl = kernel(q, k, o.implementation)
    blk = flash.block_attention(q, k, v, out_dtype=jnp.float32, **_self_kw(o, impl, seg))
    if impl == "cudnn":
        pre_blk = _prefix_cudnn(o, q, k, v, prefix_runs(seg, pre, o.prefix_runs))
    else:
        pre_blk = flash.block_attention(q, k, v, out_dtype=jnp.float32,
                                        **_prefix_xla_kw(o, seg, pre))
    return flash.merge(*blk, *pre_blk)


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
    impl = kernel(q, k, o.implementation)
    g_self = flash.block_attention_bwd(q, k, v, out, lse, do, **_self_kw(o, impl, seg))
    if impl == "cudnn":
        g_pre = _prefix_cudnn_bwd(o, q, k, v, out, lse, do,
                                  prefix_runs(seg, pre, o.prefix_runs))
    else:
        g_pre = flash.block_attention_bwd(q, k, v, out, lse, do, **_prefix_xla_kw(o, seg, pre))
    dq, dk, dv = (a + b for a, b in zip(g_self, g_pre))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_shared.defvjp(_shared_fwd, _shared_bwd)


def shared_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, prefix_ids_BT, *,
                     implementation=None, scale=None, max_segments=flash.MAX_SEGMENTS,
                     q_chunk=512, kv_chunk=512):
    """Causal attention within segments plus each response's view of its shared prefix
    (module docstring) over whole rows -> o_BTNH in q's dtype. `implementation` (None, "xla"
    or "cudnn") picks both blocks' kernel as `flash.block_attention` does (`kernel` says
    which); on cuDNN a row holds at most `max_segments` segments and `max_segments // 3`
    shared groups (NaN beyond). With `prefix_ids_BT` all 0 the result is
    `flash.dense_attention`'s."""
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
