"""How far the sampler's log-probs are from the trainer's for the same tokens.

The rollout engine and the update compute the same policy with different programs (a paged
decode kernel against a chunked training forward, bf16 against fp32 compute, different
reduction orders), so log p_sampler(y_t) and log p_trainer(y_t) differ. The difference
biases the policy gradient (the tokens were drawn from the sampler, the gradient assumes
the trainer) and, left unwatched, grows with long responses (Liu, Li et al. 2025, "When
Speed Kills Stability"). These are the numbers that watch it, per token with
Δ = log p_trainer - log p_sampler (r = e^Δ):

  abs_mean, abs_max   mean and max of |Δ|
  k1                  mean of -Δ: the plain estimate of KL(sampler || trainer) (tokens are
                      the sampler's draws); its sign says which side is more confident
  k3                  mean of r - 1 - Δ (>= 0): the low-variance estimate of the same KL, as
                      verl's rollout_corr `k3_kl`
  outside_frac        share of tokens whose r lies outside [0.5, 2] (|Δ| > log 2): what a
                      token-level TIS cap or mask of 2 would touch

and the same by a token's position in its response: [0, 256), [256, 1K), [1K, 4K), [4K, ∞)
(`EDGES`), because the mismatch of a long response hides in its tail: decode state
accumulates, and a few long samples are a small share of a step's tokens.

`mismatch_sums` reduces one micro-batch to sums (and maxima) per bucket, so any number of
micro-batches and data shards combine exactly (`combine_sums`); `finalize` turns the totals
into the metrics, named `mismatch/...` (`mismatch/pos_1k_4k/k3`: a bucket's), and leaves out
a bucket without tokens. `mismatch_metrics` is the three in one, for one batch.

Dimension letters: B batch rows · T positions.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# Response-position bucket edges (the last bucket is open): short answers, typical chains of
# thought, long ones, very long ones.
EDGES = (0, 256, 1024, 4096)
# The ratio band whose leaving is counted (verl's default TIS cap and its reciprocal).
LOW, HIGH = 0.5, 2.0
# Δ is clamped before exp, as the losses' log-ratios (one wild token must not give inf).
_MAX_LOG_RATIO = 20.0
SUM_KEYS = ("tokens", "abs_sum", "k1_sum", "k3_sum", "outside")
MAX_KEYS = ("abs_max",)


def bucket_names(edges=EDGES) -> list[str]:
    """'0_256', '256_1k', '1k_4k', '4k_inf' for the default edges."""
    def short(n):
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)
    return [f"{short(lo)}_{short(hi) if hi is not None else 'inf'}"
            for lo, hi in zip(edges, list(edges[1:]) + [None])]


def mismatch_sums(trainer_logp_BT, sampler_logp_BT, mask_BT, response_pos_BT, *,
                  edges=EDGES, low: float = LOW, high: float = HIGH) -> dict:
    """One batch's sums per response-position bucket: each value is [len(edges)] float32.

    `mask_BT` marks the tokens to measure (completion tokens); `response_pos_BT` is each
    token's 0-based index in its response. Positions off the mask may hold anything (0,
    -inf, a prompt's log-prob): they are left out before any arithmetic."""
    on_BT = jnp.asarray(mask_BT) > 0
    d_BT = jnp.where(on_BT, jnp.asarray(trainer_logp_BT, jnp.float32)
                     - jnp.asarray(sampler_logp_BT, jnp.float32), 0.0)
    dc_BT = jnp.clip(d_BT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    pos_BT = jnp.asarray(response_pos_BT)
    lo, hi = math.log(low), math.log(high)
    per_token = {"tokens": jnp.ones_like(d_BT), "abs_sum": jnp.abs(d_BT), "k1_sum": -d_BT,
                 "k3_sum": jnp.expm1(dc_BT) - dc_BT,
                 "outside": ((d_BT < lo) | (d_BT > hi)).astype(jnp.float32)}
    out = {k: [] for k in SUM_KEYS + MAX_KEYS}
    bounds = list(edges) + [None]
    for a, b in zip(bounds[:-1], bounds[1:]):
        in_BT = on_BT & (pos_BT >= a) & ((pos_BT < b) if b is not None else True)
        for k, x in per_token.items():
            out[k].append(jnp.sum(jnp.where(in_BT, x, 0.0)))
        out["abs_max"].append(jnp.max(jnp.where(in_BT, jnp.abs(d_BT), 0.0)))
    return {k: jnp.stack(v) for k, v in out.items()}


def row_sums(trainer_logp_BT, sampler_logp_BT, response_pos_BT) -> dict:
    """`mismatch_sums` of packed update rows, whose `response_pos` is each token's 1-based
    position in its response and 0 off the responses."""
    return mismatch_sums(trainer_logp_BT, sampler_logp_BT, response_pos_BT > 0,
                         response_pos_BT - 1)


def combine_sums(a: dict, b: dict) -> dict:
    """The sums of two batches: maxima by max, everything else adds."""
    return {k: (np.maximum if k in MAX_KEYS else np.add)(np.asarray(a[k]), np.asarray(b[k]))
            for k in a}


def finalize(sums: dict, edges=EDGES) -> dict:
    """Totals of `mismatch_sums` -> {'mismatch/<stat>': float, 'mismatch/pos_<bucket>/<stat>':
    float}; a bucket with no token is left out (its means do not exist), as are the overall
    means when no token was measured (then only `mismatch/tokens` = 0 is reported)."""
    s = {k: np.asarray(v, np.float64) for k, v in sums.items()}

    def stats(prefix, i=None):
        # i: one bucket; None: every bucket together
        pick = (lambda x: x.sum()) if i is None else (lambda x: x[i])  # noqa: E731
        n = float(pick(s["tokens"]))
        if n == 0:
            return {f"{prefix}tokens": 0.0}
        top = s["abs_max"].max() if i is None else s["abs_max"][i]
        return {f"{prefix}tokens": n, f"{prefix}abs_mean": float(pick(s["abs_sum"])) / n,
                f"{prefix}abs_max": float(top), f"{prefix}k1": float(pick(s["k1_sum"])) / n,
                f"{prefix}k3": float(pick(s["k3_sum"])) / n,
                f"{prefix}outside_frac": float(pick(s["outside"])) / n}

    out = stats("mismatch/")
    for i, name in enumerate(bucket_names(edges)):
        if s["tokens"][i] > 0:
            out.update(stats(f"mismatch/pos_{name}/", i))
    return out


def mismatch_metrics(trainer_logp_BT, sampler_logp_BT, mask_BT, response_pos_BT, *,
                     edges=EDGES, low: float = LOW, high: float = HIGH) -> dict:
    """The `mismatch/` metrics of one batch ([B, T] arrays; see `mismatch_sums`)."""
    return finalize(mismatch_sums(trainer_logp_BT, sampler_logp_BT, mask_BT, response_pos_BT,
                                  edges=edges, low=low, high=high), edges)
