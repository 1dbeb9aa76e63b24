"""Worked example of plugging into lrl (docs/extending.md): a pass@k advantage estimator and a
CISPO-style policy loss, selected by config without touching lrl:

    --config.rl.estimator=experiments.plugins.passk:passk_advantages
    --config.rl.loss.policy_loss=experiments.plugins.passk:cispo

Pass@k training (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
Exploitation of Large Reasoning Models"): the reward of a group of k samples is 1 when any of
them is correct, and each sample's advantage is the analytic expectation of that group reward
over the groups of k it can be in, minus its mean, over its std. With N samples of a prompt of
which n_pos are correct and n_neg = N - n_pos are not:

    R = 1 - C(n_neg, k) / C(N, k)                       mean group reward
    s = sqrt(R (1 - R))                                  its std
    A_pos = (1 - R) / s
    A_neg = (1 - R - C(n_neg - 1, k - 1) / C(N - 1, k - 1)) / s

A group all correct or all wrong gets 0. Rewards are binary: correct means reward >= 1, as
lrl's pass@k evaluation counts it.

Dimension letters: P prompts · G samples per prompt · B batch rows · T positions.
"""
from math import comb

import jax
import jax.numpy as jnp
import numpy as np

K = 2   # the k of pass@k this module's `passk_advantages` trains for


def pass_at_k_advantages(rewards_PG, k: int, mask_P=None):
    """[P, G] pass@k advantages of binary rewards (see the module docstring)."""
    correct_PG = np.asarray(rewards_PG) >= 1.0
    P, N = correct_PG.shape
    if not 1 <= k <= N:
        raise ValueError(f"passk: k={k} needs 1 <= k <= G={N} samples per prompt")
    adv_PG = np.zeros((P, N), np.float32)
    for p in range(P):
        if mask_P is not None and not mask_P[p]:
            continue                               # a padding row
        n_neg = int(N - correct_PG[p].sum())
        mean = 1.0 - comb(n_neg, k) / comb(N, k)
        std = np.sqrt(mean * (1.0 - mean))
        if std == 0.0:                             # all correct or all wrong: no signal
            continue
        a_pos = (1.0 - mean) / std
        # a wrong sample's groups of k fail when the other k - 1 are wrong too
        a_neg = (1.0 - mean - (comb(n_neg - 1, k - 1) / comb(N - 1, k - 1) if n_neg else 0.0)
                 ) / std
        adv_PG[p] = np.where(correct_PG[p], a_pos, a_neg)
    return adv_PG


def passk_advantages(rewards_PG, *, mask_P=None):
    """An outcome estimator for `rl.estimator`: pass@K advantages (K = 2 here; for another k,
    write a two-line function calling `pass_at_k_advantages` or register one with
    `lrl.rl.register_estimator`). It names `mask_P`, so lrl hands it the rows that hold a
    group (the others are padding)."""
    return pass_at_k_advantages(rewards_PG, K, mask_P)


def cispo(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg):
    """A policy loss for `rl.loss.policy_loss`: CISPO (MiniMax-M1), REINFORCE weighted by the
    importance ratio clipped to [1 - clip_low, 1 + clip_high] WITHOUT gradient, so every token
    keeps a gradient (PPO's clip zeroes it outside the band): -sg(clip(r)) * A * logp.
    Elementwise, as lrl's fused head needs. The metric is the share of tokens whose weight
    was clipped."""
    ratio = jnp.exp(jnp.clip(logp_BT - old_logp_BT, -20.0, 20.0))
    w = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
    clipped = jnp.where(w != jax.lax.stop_gradient(ratio), 1.0, 0.0)
    return -w * adv_BT * logp_BT, {"cispo_clipped_frac": clipped}
