"""Advantage estimators of the GRPO family: a pure function of the rewards of G samples per prompt.

Rows are prompts, columns the G samples drawn for one prompt. No estimator needs a value
network; each compares a sample with the other samples of its group.

Dimension letters: P prompts in a rollout batch · G samples per prompt (group size).
"""
from __future__ import annotations

import jax.numpy as jnp

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def advantages(rewards_PG, estimator: str = "grpo", eps: float = 1e-6):
    """Advantages [P, G] from rewards [P, G].

    grpo          (r - group mean) / (group std + eps), std with ddof=1 as verl and TRL.
    dr_grpo       r - group mean (Dr. GRPO drops the std division, which favours easy and
                  hopeless prompts).
    rloo          r_i - mean of the other G-1 rewards of the group (leave-one-out baseline).
    reinforce_pp  r - group mean, then whitened over the whole batch
                  ((x - batch mean) / (batch std + eps), std with ddof=1).

    A group whose G rewards are all equal gets exactly 0 from every estimator.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantages: unknown estimator {estimator!r}; valid: {ESTIMATORS}")
    r_PG = jnp.asarray(rewards_PG, jnp.float32)
    if r_PG.ndim != 2:
        raise ValueError(f"advantages: rewards_PG must be [P, G], got shape {r_PG.shape}")
    g = r_PG.shape[1]
    if g < 2:
        raise ValueError(f"advantages: group size G={g}; a group baseline needs G >= 2 "
                         "samples per prompt")
    mean_P1 = r_PG.mean(axis=1, keepdims=True)
    # A group whose rewards are all equal says nothing about which sample is better, so its
    # advantage is exactly 0. Computing it would not give 0: the float32 mean of G copies of
    # 0.7 rounds an ulp away from 0.7, and grpo divides that residual by a 1-ulp std.
    informative_P1 = r_PG.max(axis=1, keepdims=True) > r_PG.min(axis=1, keepdims=True)
    centred_PG = jnp.where(informative_P1, r_PG - mean_P1, 0.0)
    if estimator == "grpo":
        std_P1 = r_PG.std(axis=1, ddof=1, keepdims=True)
        return centred_PG / (std_P1 + eps)
    if estimator == "dr_grpo":
        return centred_PG
    if estimator == "rloo":
        # Mean of the others = (sum - r_i) / (G - 1), so r_i minus it = G/(G-1) · (r_i - mean).
        others_PG = (r_PG.sum(axis=1, keepdims=True) - r_PG) / (g - 1)
        return jnp.where(informative_P1, r_PG - others_PG, 0.0)
    # Whitening over the batch with the unbiased std (ddof=1). The batch mean of group-centred
    # values is 0 up to rounding; the constant groups are kept at exactly 0 after the shift.
    white_PG = (centred_PG - centred_PG.mean()) / (centred_PG.std(ddof=1) + eps)
    return jnp.where(informative_P1, white_PG, 0.0)
