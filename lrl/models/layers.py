"""Building blocks shared by the training decoder and the rollout engine: RMSNorm, RoPE and
the remat policies, all as plain functions or small Flax modules.

B batch · T positions · D model width · N query heads · H head dim.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lrl.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the scale, as transformers does."""
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


def inv_frequencies(cfg: ModelConfig) -> jax.Array:
    """RoPE inverse frequencies [H/2], with llama3 scaling when configured."""
    H = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    s = cfg.rope_scaling
    if s.kind == "default":
        return inv
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly (transformers' _compute_llama3_parameters).
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_angles(cfg: ModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, H] in fp32 (the two halves repeated, as rotate_half expects).

    With `cfg.mrope_section` set, positions may also be [3, B, T] (temporal, height, width):
    frequency section i takes its angle from position component i % 3, as transformers'
    Qwen2.5-VL rotary embedding does. [B, T] positions then mean all three components equal.
    """
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_frequencies(cfg)
    if positions_BT.ndim == 3:
        if not cfg.mrope_section or positions_BT.shape[0] != 3:
            raise ValueError(f"rope_angles: positions of shape {positions_BT.shape} need "
                             "cfg.mrope_section and a leading axis of 3 (t, h, w)")
        component = np.repeat(np.arange(len(cfg.mrope_section)) % 3, cfg.mrope_section)
        freqs_BTh = jnp.where(component == 0, freqs_BTh[0],
                              jnp.where(component == 1, freqs_BTh[1], freqs_BTh[2]))
    emb = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
    x = x_BTNH.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
    return out.astype(x_BTNH.dtype)


def remat_policy(name: str):
    """Named rematerialisation policies for the scanned layer (`cfg.remat`).

    none: keep every activation (most memory); full: keep only each layer's input;
    dots / dots_no_batch: keep matmul outputs; dots_attn: dots_no_batch plus the attention
    output and log-sum-exp, so the backward runs no attention forward again (the fastest
    where it fits: attention is the costliest op of a long row, and what it keeps is small,
    T·N·H + T·N per layer); save_attn: keep only the attention output and log-sum-exp,
    recompute the rest; offload_attn: as save_attn but what is kept lives in pinned host
    memory, which lets the longest sequences fit.
    """
    cp = jax.checkpoint_policies
    attn = ("attn_out", "attn_lse")  # named by every attention kernel's forward
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.checkpoint_dots
    if name == "dots_no_batch":
        return cp.dots_with_no_batch_dims_saveable
    if name == "dots_attn":
        return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                          cp.save_only_these_names(*attn))
    if name == "save_attn":
        return cp.save_only_these_names(*attn)
    if name == "offload_attn":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(attn),
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"unknown remat policy {name!r}")
