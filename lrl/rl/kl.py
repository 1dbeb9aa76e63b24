"""KL to the reference in the reward, as verl's `apply_kl_penalty` (`algorithm.use_kl_in_reward`),
and the KL coefficient's controllers (fixed, and verl's AdaptiveKLController) as pure functions
of a float coefficient, so the coefficient is a plain number the checkpoint keeps.

Token form (token-level estimators such as GAE): each response token's reward becomes
r_t - beta * kl_t, kl_t an estimate of KL(pi_old || pi_ref) at that token from the old and
reference log-probs (`losses`' estimators: k1, k2, k3 = verl's low_var_kl).
Outcome form (estimators that read one score per sample, GRPO and its family): verl's GRPO with
KL in the reward sums the token rewards, so a sample's score becomes R - beta * sum_t kl_t
(`kl_in_score`).

Dimension letters: B batch rows · T positions · P prompts · G samples per prompt.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# The loss's estimators, shared (one definition of each: the clamps are documented there).
from lrl.rl.losses import _kl as _loss_kl

# verl's names for the same estimators.
KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_CONTROLS = ("fixed", "adaptive")


def token_kl(logp_BT, ref_logp_BT, mask_BT, estimator: str = "k1"):
    """Per-token KL estimate of logp against ref_logp, 0 off the mask: k1 = logp - ref, k2 =
    ½(logp - ref)², k3 / low_var_kl = min(e^(ref-logp) - (ref-logp) - 1, 10), ref - logp
    clamped to [-20, 20] first (`lrl.rl.losses`)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl: unknown estimator {estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
    logp_BT = jnp.asarray(logp_BT, jnp.float32)
    ref_BT = jnp.asarray(ref_logp_BT, jnp.float32)
    on_BT = jnp.asarray(mask_BT) > 0
    # Off the mask the log-probs may be anything (padding, -inf): keep them out of exp.
    kl_BT = _loss_kl(jnp.where(on_BT, logp_BT, 0.0), jnp.where(on_BT, ref_BT, 0.0),
                     KL_ESTIMATORS[estimator])
    return jnp.where(on_BT, kl_BT, 0.0)


def segment_sums(x_BT, segment_ids_BT):
    """[B, T+1]: out[b, s] = Σ of x over row b's positions with segment id s (s = 0 is
    padding); a packed sequence's total, read where its row and id are."""
    x_BT = jnp.asarray(x_BT, jnp.float32)
    seg_BT = jnp.asarray(segment_ids_BT, jnp.int32)
    b, t = x_BT.shape
    return jnp.zeros((b, t + 1), jnp.float32).at[jnp.arange(b)[:, None], seg_BT].add(x_BT)


def kl_penalty(token_rewards_BT, old_logp_BT, ref_logp_BT, mask_BT, beta, estimator: str = "k1",
               segment_ids_BT=None):
    """verl's apply_kl_penalty -> (token_rewards_BT - beta * kl_BT, metrics).

    kl_BT = `token_kl(old_logp, ref_logp, mask, estimator)` (verl's default is k1, "kl").
    `segment_ids_BT` None: each row is one sequence; else packed rows (0 = padding). metrics:
    kl, verl's current_kl (the mean over sequences of each sequence's mean token KL; the
    adaptive controller reads it), from kl_seq_mean_sum / kl_sequences (which add up over
    micro-batches: combine them that way for a step's kl), and kl_coef = beta. Sequences with
    no masked token are left out of the mean."""
    r_BT = jnp.asarray(token_rewards_BT, jnp.float32)
    m_BT = jnp.asarray(mask_BT, jnp.float32)
    for name, a in dict(old_logp_BT=old_logp_BT, ref_logp_BT=ref_logp_BT, mask_BT=mask_BT).items():
        if jnp.shape(a) != r_BT.shape:
            raise ValueError(f"kl_penalty: {name} has shape {jnp.shape(a)}, expected {r_BT.shape}")
    seg_BT = (jnp.ones(r_BT.shape, jnp.int32) if segment_ids_BT is None
              else jnp.asarray(segment_ids_BT, jnp.int32))
    m_BT = jnp.where(seg_BT > 0, m_BT, 0.0)
    kl_BT = token_kl(old_logp_BT, ref_logp_BT, m_BT, estimator)
    tokens = segment_sums(m_BT, seg_BT)[:, 1:]
    per_seq = segment_sums(kl_BT, seg_BT)[:, 1:] / jnp.maximum(tokens, 1.0)
    seq_sum = jnp.sum(jnp.where(tokens > 0, per_seq, 0.0))
    n = jnp.sum(tokens > 0).astype(jnp.float32)
    metrics = {"kl": seq_sum / jnp.maximum(n, 1.0), "kl_seq_mean_sum": seq_sum,
               "kl_sequences": n, "kl_coef": jnp.asarray(beta, jnp.float32)}
    return r_BT - beta * kl_BT, metrics


def sequence_kl(old_logp_BT, ref_logp_BT, mask_BT, estimator: str = "k1"):
    """[B] Σ_t kl_t of each row's sequence (padded rows): what the outcome form subtracts."""
    return jnp.sum(token_kl(old_logp_BT, ref_logp_BT, mask_BT, estimator), axis=1)


def kl_in_score(scores, kl_sums, beta):
    """The outcome form: a sample's score R - beta * Σ_t kl_t (any matching shapes, e.g. [P, G]
    rewards and the per-sample sums of `sequence_kl` or `segment_sums`), as verl's GRPO reads
    the sum of KL-penalised token rewards."""
    scores = np.asarray(scores, np.float32)
    kl_sums = np.asarray(kl_sums, np.float32)
    if scores.shape != kl_sums.shape:
        raise ValueError(f"kl_in_score: scores {scores.shape} and kl_sums {kl_sums.shape} differ")
    return scores - np.float32(beta) * kl_sums


def update_kl_coef(coef: float, current_kl: float, n_steps: int, *, control: str = "fixed",
                   target_kl: float = 0.1, horizon: float = 10000.0) -> float:
    """The next KL coefficient (a float the checkpoint keeps) after a batch of `n_steps`
    sequences (verl passes the batch size) whose KL was `current_kl`.

    fixed:    coef unchanged.
    adaptive: verl's AdaptiveKLController (Ziegler et al. 2019): e = clip(current_kl / target_kl
              - 1, -0.2, 0.2); coef * (1 + e * n_steps / horizon)."""
    if control == "fixed":
        return float(coef)
    if control != "adaptive":
        raise ValueError(f"kl control: unknown control {control!r}; valid: {KL_CONTROLS}")
    if target_kl <= 0 or horizon <= 0:
        raise ValueError(f"kl control: adaptive needs target_kl > 0 and horizon > 0, got "
                         f"target_kl={target_kl}, horizon={horizon}")
    error = float(np.clip(float(current_kl) / target_kl - 1.0, -0.2, 0.2))
    return float(coef) * (1.0 + error * n_steps / horizon)
