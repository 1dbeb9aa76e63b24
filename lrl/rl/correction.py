"""Rollout correction: weights and masks that account for the sampler not being the policy
the update differentiates, per token, over packed rows.

The tokens of a step were drawn by the sampler (log-probs `rollout_logp`, from the rollout
engine) but the loss treats them as the trainer's draws (`old_logp`, the trainer's forward
of the same parameters before the update). With Δ_t = old_logp_t - rollout_logp_t, the
token ratio is ρ_t = e^Δ_t; numerics alone (bf16 decode kernels against an fp32 forward)
make it differ from 1 (lrl.rl.mismatch measures by how much), a stale sampler more so.
Three levels of a sequence's ratio, each computed over its trained tokens only:

  token       ρ_t                              the token's own
  sequence    ∏ ρ_t = exp(Σ Δ_t)               the sequence's true likelihood ratio
  geometric   exp(mean Δ_t)                    its per-token geometric mean: the sequence
                                               product's length-neutral form

`is_weight`: truncated importance sampling, min(ratio, cap) without gradient, at any level
(token: verl's TIS and lrl's `tis_cap` of old; sequence: verl's `rollout_is="sequence"`;
geometric: the geometric mean capped alike). `keep_mask`: masked importance sampling, 0
for a token (token level) or for every token of a sequence (sequence, geometric) whose
ratio leaves [low, high], as the token / sequence / geometric levels of verl's rejection
sampling (`rollout_rs` with `rollout_rs_threshold(_lower)`, before verl moved to KL-based
filters) and SkyRL's geometric sequence mask. One difference: the loss keeps the
denominators of its loss mask (a masked token adds 0), as verl's IcePop weights do, where
verl's rejection removes the tokens from the mask first; under token_mean, masking a share
m of the tokens gives (1 - m) times verl's loss. That keeps the denominators computed once
on the host, before the old log-probs exist. `staleness_weight`: a weight from a sample's
age in policy versions (the number of optimizer steps between the parameters that sampled
it and those that train on it).

All are stop-gradient constants of old and rollout log-probs, so they can be formed before
the lm head's fused pass (lrl.rl.fused_head) as well as inside the unfused loss. A sequence
lies within one row, so its sums are taken within its row and a micro-batch's values do not
depend on the other micro-batches. Log-ratios are clamped to [-20, 20] before exp, as verl's
SAFETY_BOUND and the losses' own.

Dimension letters: B batch rows · T positions.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LEVELS = ("token", "sequence", "geometric")
_MAX_LOG_RATIO = 20.0


def _slot_sums(x_BT, segment_ids_BT):
    """Sums of x per (row, segment id) -> ([B * (T + 1)] sums, [B, T] each position's slot)."""
    b, t = segment_ids_BT.shape
    slots_BT = segment_ids_BT + (t + 1) * jnp.arange(b, dtype=segment_ids_BT.dtype)[:, None]
    return jax.ops.segment_sum(x_BT.reshape(-1), slots_BT.reshape(-1),
                               num_segments=b * (t + 1)), slots_BT


def per_sequence(x_BT, segment_ids_BT):
    """Each position's sum of x over its own segment (its sequence in its row), [B, T]."""
    sums, slots_BT = _slot_sums(x_BT, segment_ids_BT)
    return sums[slots_BT]


def level_log_ratio(log_ratio_BT, on_BT, segment_ids_BT, level: str):
    """log of the ratio at `level` on every position: the token's own Δ, or its sequence's
    Σ Δ or mean Δ over the sequence's trained tokens (`on_BT`). 0 off `on_BT`."""
    d_BT = jnp.where(on_BT, log_ratio_BT.astype(jnp.float32), 0.0)
    if level == "token":
        return d_BT
    if segment_ids_BT is None:
        raise ValueError(f"correction: level {level!r} needs segment ids (a sequence's sum)")
    total_BT = per_sequence(d_BT, segment_ids_BT)
    if level == "sequence":
        return jnp.where(on_BT, total_BT, 0.0)
    if level == "geometric":
        count_BT = per_sequence(on_BT.astype(jnp.float32), segment_ids_BT)
        return jnp.where(on_BT, total_BT / jnp.maximum(count_BT, 1.0), 0.0)
    raise ValueError(f"correction: unknown level {level!r}; valid: {LEVELS}")


def is_weight(log_ratio_BT, on_BT, segment_ids_BT, *, level: str, cap: float):
    """Truncated IS weight min(ratio, cap) at `level`, without gradient; 1 off `on_BT`."""
    lr_BT = level_log_ratio(log_ratio_BT, on_BT, segment_ids_BT, level)
    w_BT = jnp.minimum(jnp.exp(jnp.clip(lr_BT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)), cap)
    return jax.lax.stop_gradient(jnp.where(on_BT, w_BT, 1.0))


def keep_mask(log_ratio_BT, on_BT, segment_ids_BT, *, level: str, low: float, high: float):
    """1.0 where the ratio at `level` lies in [low, high] (or off `on_BT`), else 0.0: at the
    sequence and geometric levels every token of a sequence shares its verdict."""
    lr_BT = level_log_ratio(log_ratio_BT, on_BT, segment_ids_BT, level)
    inside = (lr_BT >= math.log(low)) & (lr_BT <= math.log(high))
    return jax.lax.stop_gradient(jnp.where(on_BT & ~inside, 0.0, 1.0))


def staleness_weight(age, *, decay: float = 1.0, max_age: int | None = None):
    """A sample's weight from its age in policy versions (0: sampled by the parameters being
    trained): decay ** age, and 0 past `max_age` (None: no bound). decay = 1 and no bound
    weigh every sample 1. Elementwise over any shape; without gradient."""
    age = jnp.asarray(age, jnp.float32)
    w = jnp.power(jnp.float32(decay), age)
    if max_age is not None:
        w = jnp.where(age <= max_age, w, 0.0)
    return jax.lax.stop_gradient(w)


def masked_sequences(keep_BT, on_BT, segment_ids_BT):
    """How many sequences lost at least one trained token to `keep_mask` (scalar)."""
    # Padding (segment 0) is never on, so its slot counts nothing.
    per_slot, _ = _slot_sums(jnp.where(on_BT & (keep_BT == 0), 1.0, 0.0), segment_ids_BT)
    return jnp.sum(per_slot > 0).astype(jnp.float32)
