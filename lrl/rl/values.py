"""The critic's clipped value loss, as verl's `compute_value_loss`, aggregated with the policy
loss's modes (`lrl.rl.losses`: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm).

    vpredclipped = clip(v, old - c, old + c)
    loss = 0.5 * agg(max((v - R)^2, (vpredclipped - R)^2))

`packed_value_loss` is one micro-batch's share of a minibatch (packed rows, segment ids, the
minibatch's `Denominators`), so the shares of micro-batches and data shards add up to the
minibatch's loss, gradient and metrics, exactly as `packed_policy_loss`; `value_loss` is the
plain [B, T] form (one sequence per row) written over it.

Dimension letters: B batch rows · T positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lrl.rl.losses import AGGREGATIONS, Denominators, loss_denominators, token_weights


def packed_value_loss(values_BT, old_values_BT, returns_BT, mask_BT, segment_ids_BT,
                      denoms: Denominators, cliprange_value: float, aggregation: str):
    """One micro-batch's share of the clipped value loss -> (loss, metrics). `denoms` come
    from `losses.loss_denominators` (or `update.host_denominators`) over the whole minibatch.
    Metrics add up over micro-batches (extremes aside, see `losses.combine_metrics`):
    vf_loss, vf_clipfrac (share of masked tokens where the clipped term is the larger, verl's
    strict >), vpred_mean, vpred_min / vpred_max, returns_mean, vf_tokens."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"value_loss: unknown aggregation {aggregation!r}; valid: {AGGREGATIONS}")
    if cliprange_value < 0:
        raise ValueError(f"value_loss: cliprange_value must be >= 0, got {cliprange_value}")
    v_BT = jnp.asarray(values_BT, jnp.float32)
    arrays = dict(old_values_BT=old_values_BT, returns_BT=returns_BT, mask_BT=mask_BT,
                  segment_ids_BT=segment_ids_BT)
    for name, a in arrays.items():
        if jnp.shape(a) != v_BT.shape:
            raise ValueError(f"value_loss: {name} has shape {jnp.shape(a)}, expected {v_BT.shape}")
    old_BT = jnp.asarray(old_values_BT, jnp.float32)
    ret_BT = jnp.asarray(returns_BT, jnp.float32)
    seg_BT = jnp.asarray(segment_ids_BT)
    w_BT = token_weights(jnp.asarray(mask_BT), seg_BT, denoms, aggregation)
    on_BT = (seg_BT > 0) & (jnp.asarray(mask_BT) > 0)

    clipped_BT = jnp.clip(v_BT, old_BT - cliprange_value, old_BT + cliprange_value)
    sq1_BT = (v_BT - ret_BT) ** 2
    sq2_BT = (clipped_BT - ret_BT) ** 2
    # Off the mask anything may stand there (padding): keep it out of the sum.
    loss = 0.5 * jnp.sum(w_BT * jnp.where(on_BT, jnp.maximum(sq1_BT, sq2_BT), 0.0))

    tok = jnp.maximum(denoms.tokens, 1.0)
    v_sg = jax.lax.stop_gradient(v_BT)
    metrics = {
        "vf_loss": loss,
        "vf_clipfrac": jnp.sum(jnp.where(on_BT & (sq2_BT > sq1_BT), 1.0, 0.0)) / tok,
        "vpred_mean": jnp.sum(jnp.where(on_BT, v_sg, 0.0)) / tok,
        "vpred_min": jnp.min(jnp.where(on_BT, v_sg, jnp.inf)),
        "vpred_max": jnp.max(jnp.where(on_BT, v_sg, -jnp.inf)),
        "returns_mean": jnp.sum(jnp.where(on_BT, ret_BT, 0.0)) / tok,
        "vf_tokens": jnp.sum(on_BT.astype(jnp.float32)),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def value_loss(values_BT, old_values_BT, returns_BT, mask_BT, cliprange_value: float,
               aggregation: str = "token_mean", max_len: int | None = None):
    """verl's clipped value loss of B sequences (one per row) -> (loss, metrics); see
    `packed_value_loss`. seq_mean_token_sum_norm divides by B · max_len (max_len defaulting
    to T), as `losses.policy_loss` does."""
    v_BT = jnp.asarray(values_BT)
    if v_BT.ndim != 2:
        raise ValueError(f"value_loss: values_BT must be [B, T], got shape {v_BT.shape}")
    b, t = v_BT.shape
    seg_BT = jnp.ones((b, t), jnp.int32)
    denoms = loss_denominators(jnp.asarray(mask_BT), seg_BT)._replace(
        sum_norm=jnp.asarray(float(b * (t if max_len is None else max_len)), jnp.float32))
    return packed_value_loss(v_BT, old_values_BT, returns_BT, mask_BT, seg_BT, denoms,
                             cliprange_value, aggregation)
