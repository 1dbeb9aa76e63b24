"""Generalized advantage estimation (GAE) over token rewards and a critic's values, as verl's
`compute_gae_advantage_return`, on padded rows (`gae`) and on packed rows (`gae_packed`), with
the whitening split into combinable statistics (`whiten_stats`, `combine_stats`, `whiten`) so
that it can run over a whole step's response tokens spread over many micro-batches and data
shards.

The recurrence (verl's masked form, which skips observation tokens): going backwards over a
sequence, with m_t the response mask,
    delta_t     = r_t + gamma * nextvalue_t - v_t
    lastgaelam  = m_t * (delta_t + gamma * lam * lastgaelam) + (1 - m_t) * lastgaelam
    nextvalue   = m_t * v_t + (1 - m_t) * nextvalue          (for position t - 1)
so a masked-out position passes both carries through unchanged: nextvalue_t is the value at
the nearest response position after t (0 past the last), and the advantage at t is
lastgaelam after step t. Returns are advantages + values, taken BEFORE the whitening.

Both carries are linear recurrences x_t = a_t * x_{t+1} + b_t, so they run as
`jax.lax.associative_scan` over T (log T depth; no T-step loop on the device), under jit and
over rows sharded across devices alike.

Dimension letters: B batch rows · T positions.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8), the variance unbiased.
WHITEN_VAR_EPS = 1e-8


def _reverse_linear_scan(a_BT, b_BT):
    """x_t = a_t * x_{t+1} + b_t for t = T-1 .. 0 with x_T = 0, along axis 1 -> x_BT."""
    def combine(later, earlier):
        # `later` holds the composition of positions after `earlier`'s (reverse scan): apply
        # the later map first, then the earlier one.
        a_l, b_l = later
        a_e, b_e = earlier
        return a_e * a_l, a_e * b_l + b_e

    _, x_BT = jax.lax.associative_scan(combine, (a_BT, b_BT), reverse=True, axis=1)
    return x_BT


def _raw_gae(r_BT, v_BT, m_BT, keep_BT, gamma, lam):
    """The un-whitened advantages of the masked recurrence. `keep_BT[t]` = 0 cuts the carries
    between t and t + 1 (t + 1 starts another sequence); 1 elsewhere."""
    # nextvalue used at t: y_t = keep_t * (m_{t+1} v_{t+1} + (1 - m_{t+1}) y_{t+1}).
    m_next = jnp.pad(m_BT[:, 1:], ((0, 0), (0, 1)))
    v_next = jnp.pad(v_BT[:, 1:], ((0, 0), (0, 1)))
    keep_next = jnp.pad(keep_BT[:, 1:], ((0, 0), (0, 1)))
    # Write y_t = keep_t * z_{t+1} with z_s = m_s v_s + (1 - m_s) keep_s z_{s+1}.
    z_next = _reverse_linear_scan((1.0 - m_next) * keep_next, m_next * v_next)
    nextvalues_BT = keep_BT * z_next
    delta_BT = r_BT + gamma * nextvalues_BT - v_BT
    # lastgaelam_t = (m_t gamma lam + 1 - m_t) * keep_t * lastgaelam_{t+1} + m_t delta_t.
    a_BT = (m_BT * (gamma * lam) + (1.0 - m_BT)) * keep_BT
    return _reverse_linear_scan(a_BT, m_BT * delta_BT)


def gae(token_rewards_BT, values_BT, mask_BT, gamma, lam):
    """verl's `compute_gae_advantage_return` on padded rows (each row one sequence's
    response) -> (advantages_BT, returns_BT), float32.

    returns = raw advantages + values; advantages = the raw ones whitened over the masked
    (response) tokens of the whole batch: (x - mean) * rsqrt(var + 1e-8), var unbiased
    (verl's masked_whiten). As in verl, every position gets a value (masked-out ones carry
    their neighbours'); only the masked ones mean anything."""
    r_BT, v_BT, m_BT = (jnp.asarray(x, jnp.float32) for x in (token_rewards_BT, values_BT,
                                                             mask_BT))
    if r_BT.ndim != 2 or r_BT.shape != v_BT.shape or r_BT.shape != m_BT.shape:
        raise ValueError(f"gae: token_rewards_BT, values_BT and mask_BT must be one [B, T] shape, "
                         f"got {r_BT.shape}, {v_BT.shape}, {m_BT.shape}")
    raw_BT = _raw_gae(r_BT, v_BT, m_BT, jnp.ones_like(m_BT), gamma, lam)
    # verl's two-pass moments, and every position whitened (as masked_whiten does).
    n = m_BT.sum()
    mean = jnp.sum(m_BT * raw_BT) / n
    var = jnp.sum(m_BT * (raw_BT - mean) ** 2) / (n - 1.0)
    return (raw_BT - mean) * jax.lax.rsqrt(var + WHITEN_VAR_EPS), raw_BT + v_BT


def gae_packed(token_rewards_BT, values_BT, mask_BT, segment_ids_BT, gamma, lam):
    """GAE on packed rows (several sequences per row, `segment_ids_BT` 0 = padding; `mask_BT`
    marks the response tokens) -> (raw_advantages_BT, returns_BT), float32, NOT whitened
    (whiten over the whole step with `whiten_stats` / `combine_stats` / `whiten`).

    The recurrence runs within each segment alone (its carries reset where the segment id
    changes), so each sequence gets what `gae` computes for it on a row of its own, before
    the whitening. Both outputs are 0 off the mask and on padding."""
    r_BT, v_BT, m_BT = (jnp.asarray(x, jnp.float32) for x in (token_rewards_BT, values_BT,
                                                             mask_BT))
    seg_BT = jnp.asarray(segment_ids_BT)
    if not (r_BT.ndim == 2 and r_BT.shape == v_BT.shape == m_BT.shape == seg_BT.shape):
        raise ValueError(f"gae_packed: token_rewards_BT, values_BT, mask_BT and segment_ids_BT "
                         f"must be one [B, T] shape, got {r_BT.shape}, {v_BT.shape}, "
                         f"{m_BT.shape}, {seg_BT.shape}")
    m_BT = jnp.where(seg_BT > 0, m_BT, 0.0)
    # keep_t: position t + 1 continues t's segment (the last position has no successor).
    same_BT = jnp.pad(seg_BT[:, 1:] == seg_BT[:, :-1], ((0, 0), (0, 1)))
    raw_BT = _raw_gae(r_BT, v_BT, m_BT, same_BT.astype(jnp.float32), gamma, lam)
    on_BT = m_BT > 0
    return jnp.where(on_BT, raw_BT, 0.0), jnp.where(on_BT, raw_BT + v_BT, 0.0)


def outcome_token_rewards(score_BT, mask_BT, segment_ids_BT):
    """Token rewards of an outcome score, as verl lays them out: each sequence's score on its
    last response (masked) token, 0 elsewhere. `score_BT` holds the sequence's score on its
    tokens (as the packer lays out a per-sequence value, e.g. `seq_values`); packed rows
    (`segment_ids_BT`, 0 = padding) or one sequence a row alike."""
    seg_BT = jnp.asarray(segment_ids_BT, jnp.int32)
    on_BT = (jnp.asarray(mask_BT) > 0) & (seg_BT > 0)
    b, t = on_BT.shape
    pos_BT = jnp.where(on_BT, jnp.arange(t)[None, :], -1)
    last_BS = jnp.full((b, t + 1), -1, jnp.int32).at[jnp.arange(b)[:, None], seg_BT].max(pos_BT)
    is_last_BT = on_BT & (jnp.take_along_axis(last_BS, seg_BT, axis=1) == jnp.arange(t)[None, :])
    return jnp.where(is_last_BT, jnp.asarray(score_BT, jnp.float32), 0.0)


class WhitenStats(NamedTuple):
    """Sums of a whitening's masked values: they add up over micro-batches and shards."""
    sum: jax.Array
    sumsq: jax.Array
    count: jax.Array


def whiten_stats(x_BT, mask_BT) -> WhitenStats:
    """(Σ m·x, Σ m·x², Σ m) over the masked entries (m > 0 counts with its weight)."""
    x_BT = jnp.asarray(x_BT, jnp.float32)
    m_BT = jnp.asarray(mask_BT, jnp.float32)
    return WhitenStats(jnp.sum(m_BT * x_BT), jnp.sum(m_BT * x_BT * x_BT), jnp.sum(m_BT))


def combine_stats(*stats: WhitenStats) -> WhitenStats:
    """The statistics of the union of the parts (e.g. a step's micro-batches)."""
    return WhitenStats(*(sum(s[i] for s in stats) for i in range(3)))


def moments(stats: WhitenStats):
    """(mean, unbiased variance) from the sums. The variance is Σx²/n - mean² scaled by
    n/(n-1): exact for advantages, whose mean is small next to their spread (float32 loses
    digits when |mean| >> std; verl's two-pass form does not)."""
    n = jnp.asarray(stats.count, jnp.float32)
    mean = stats.sum / n
    var = jnp.maximum(stats.sumsq / n - mean * mean, 0.0) * n / (n - 1.0)
    return mean, var


def whiten(x_BT, mask_BT, stats: WhitenStats):
    """(x - mean) * rsqrt(var + 1e-8) with the moments of `stats` (verl's masked_whiten when
    they are x's own); 0 off the mask."""
    mean, var = moments(stats)
    x_BT = jnp.asarray(x_BT, jnp.float32)
    return jnp.where(jnp.asarray(mask_BT) > 0, (x_BT - mean) * jax.lax.rsqrt(var + WHITEN_VAR_EPS),
                     0.0)
