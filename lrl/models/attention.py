"""Attention as a pluggable function of (q, k, v, segment ids).

`cfg.attention` picks the path: "dense" (the whole sequence on each device: the XLA
reference, or cuDNN flash attention on GPU), "ring" (ring attention over the mesh's `seq`
axis) and "ulysses" (all-to-all between sequence and heads). Masking is causal by token index
within a segment: packed rows never attend across segments, except that in the shared-prompt
layout (`prefix_ids`, `lrl.data.shared_prompt`) a response also sees its group's prompt
prefix (`lrl.models.shared_attention`, on every path).

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim · Q query heads per kv head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lrl.models.config import ModelConfig


def xla_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, index_BT=None):
    """The reference: materialises [B, K, Q, T, S] scores, so only for short sequences."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if index_BT is None:
        index_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones((B, T), jnp.int32)
    q = q_BTNH.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkqh,bskh->bkqts", q, k_BSKH,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(H))
    visible_BTS = ((segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
                   & (index_BT[:, None, :] <= index_BT[:, :, None]))
    scores = jnp.where(visible_BTS[:, None, None], scores, -jnp.inf)
    # A row with no visible key (impossible when causal self-attention is on) gives zeros.
    any_visible = visible_BTS.any(-1)[:, None, None, :, None]
    weights = jax.nn.softmax(jnp.where(any_visible, scores, 0.0), axis=-1)
    weights = jnp.where(any_visible, weights, 0.0)
    out = jnp.einsum("bkqts,bskh->btkqh", weights.astype(v_BSKH.dtype), v_BSKH,
                     preferred_element_type=jnp.float32)
    # Named as the flash kernels name theirs (lrl.models.layers.remat_policy).
    return checkpoint_name(out.reshape(B, T, N, H).astype(q_BTNH.dtype), "attn_out")


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def dense_attention(cfg: ModelConfig, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
    half = q_BTNH.dtype in (jnp.bfloat16, jnp.float16)   # cuDNN's flash kernels take no fp32
    impl = cfg.attention_impl or ("cudnn" if _on_gpu() and half else "xla")
    if impl == "xla":
        return xla_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    if impl == "cudnn":
        from lrl.models import flash
        return flash.dense_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT,
                                     implementation="cudnn", max_segments=cfg.max_segments)
    raise ValueError(f"attention_impl={impl!r}; choose 'xla' or 'cudnn'")


def attend(cfg: ModelConfig, mesh, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT,
           prefix_ids_BT=None):
    """Dispatches on cfg.attention. Ring inputs arrive in the ring's token layout (the decoder
    permutes them); the others in natural order. `prefix_ids_BT`: the shared-prompt layout's
    (None: none shared)."""
    seq_sharded = mesh is not None and mesh.shape["seq"] > 1
    if prefix_ids_BT is not None and segment_ids_BT is None:
        raise ValueError("attention: prefix_ids (a shared prompt) need segment ids")
    shared = {} if prefix_ids_BT is None else {"prefix_ids_BT": prefix_ids_BT}
    if cfg.attention == "dense" or not seq_sharded:
        if cfg.attention == "ring" and mesh is not None:
            from lrl.models import ring  # one-shard ring: same kernel, no hops
            return ring.ring_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, mesh=mesh,
                                       implementation=cfg.attention_impl,
                                       max_segments=cfg.max_segments, **shared)
        if shared:
            from lrl.models import shared_attention
            return shared_attention.shared_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT,
                                                     prefix_ids_BT,
                                                     implementation=cfg.attention_impl,
                                                     max_segments=cfg.max_segments)
        return dense_attention(cfg, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    if cfg.attention == "ring":
        from lrl.models import ring
        return ring.ring_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, mesh=mesh,
                                   implementation=cfg.attention_impl,
                                   max_segments=cfg.max_segments, **shared)
    if cfg.attention == "ulysses":
        from lrl.models import ulysses
        return ulysses.ulysses_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, mesh=mesh,
                                         implementation=cfg.attention_impl,
                                         max_segments=cfg.max_segments, **shared)
    raise ValueError(f"attention={cfg.attention!r}")
