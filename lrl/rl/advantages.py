"""Advantage estimators of the GRPO family: a pure function of the rewards of G samples per prompt.

Rows are prompts, columns the G samples drawn for one prompt. No estimator here needs a value
network; each compares a sample with the other samples of its group, or (ReMax) with the
reward of a greedy sample of the same prompt. They are registered by name in
`lrl.rl.registry`, where "gae" (token-level, with a critic: `lrl.rl.gae`) and estimators of
one's own ("pkg.module:function") join them; `advantages` runs any outcome estimator.

Dimension letters: P prompts in a rollout batch · G samples per prompt (group size).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lrl.rl import registry
from lrl.rl.gae import gae

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_token")
ESTIMATORS = GROUP_ESTIMATORS + ("remax",)   # the built-in outcome estimators
# verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8).
_WHITEN_VAR_EPS = 1e-8


def advantages(rewards_PG, estimator: str = "grpo", eps: float = 1e-6, lengths_PG=None,
               mask_P=None, baseline_P=None):
    """Advantages [P, G] from rewards [P, G] (one scalar per sample; the loss gives it to every
    token of the sample's response) by the outcome estimator `estimator`: a registered name
    (`lrl.rl.registry`) or "pkg.module:function", given the optional inputs among
    `lengths_PG`, `mask_P`, `baseline_P` and `eps` that its signature names. Rows outside
    `mask_P` get 0 whatever the estimator returns. The built-ins are `group_advantages`'s
    and ReMax (`remax`)."""
    est = registry.estimator(estimator, key="advantages: estimator")
    if est.kind != "outcome":
        raise ValueError(f"advantages: estimator {estimator!r} is token-level (it needs "
                         f"token rewards{' and a critic' if est.needs_critic else ''}; see "
                         "lrl.rl.gae), not a function of one reward per sample")
    r_PG = np.asarray(rewards_PG, np.float32)
    if r_PG.ndim != 2:
        raise ValueError(f"advantages: rewards_PG must be [P, G], got shape {r_PG.shape}")
    given = dict(lengths_PG=lengths_PG, mask_P=mask_P, baseline_P=baseline_P, eps=eps)
    kwargs = {k: given[k] for k in est.wants if given[k] is not None}
    adv_PG = np.asarray(est.fn(r_PG, **kwargs), np.float32)
    if adv_PG.shape != r_PG.shape:
        raise ValueError(f"advantages: estimator {estimator!r} returned shape {adv_PG.shape}, "
                         f"expected [P, G] = {r_PG.shape}")
    if mask_P is not None:
        adv_PG = np.where(np.asarray(mask_P, bool)[:, None], adv_PG, 0.0).astype(np.float32)
    return jnp.asarray(adv_PG)


def remax(rewards_PG, *, baseline_P=None, mask_P=None):
    """ReMax (Li et al. 2023), as verl's compute_remax_outcome_advantage for an outcome
    reward: r - b, where b is the reward of a greedy (temperature 0) sample of the same
    prompt (`baseline_P` [P]; the rollout draws and scores it, and it is not trained on).
    Any G >= 1; a group all equal to each other still learns when its baseline differs."""
    r_PG = jnp.asarray(rewards_PG, jnp.float32)
    if baseline_P is None:
        raise ValueError("advantages: remax needs baseline_P, the reward of one greedy sample "
                         "per prompt (the rollout draws it when the estimator asks for it)")
    b_P = jnp.asarray(baseline_P, jnp.float32)
    if b_P.shape != r_PG.shape[:1]:
        raise ValueError(f"advantages: baseline_P has shape {b_P.shape}, rewards_PG "
                         f"{tuple(r_PG.shape)}")
    adv_PG = r_PG - b_P[:, None]
    if mask_P is not None:
        adv_PG = jnp.where(jnp.asarray(mask_P, bool)[:, None], adv_PG, 0.0)
    return adv_PG


def group_advantages(rewards_PG, estimator: str = "grpo", eps: float = 1e-6, lengths_PG=None,
                     mask_P=None):
    """The group estimators, by name (registered as such, each one a thin function below).

    grpo          (r - group mean) / (group std + eps), std with ddof=1 as verl and TRL.
    dr_grpo       r - group mean (Dr. GRPO drops the std division, which favours easy and
                  hopeless prompts).
    rloo          r_i - mean of the other G-1 rewards of the group (leave-one-out baseline).
    reinforce_pp  REINFORCE++ with a group baseline, each sample weighing one: r - group mean,
                  then whitened over the P·G samples ((x - mean) / (std + eps), std ddof=1).
                  The default REINFORCE++ form (it needs no lengths).
    reinforce_pp_token  the same whitened over response TOKENS, as verl's
                  reinforce_plus_plus_baseline: the centred score c_i stands on each of the
                  lengths_PG[i] tokens of sample i, so longer responses weigh more; with
                  N = Σ lengths, mean = Σ L_i c_i / N, var = Σ L_i (c_i - mean)² / (N - 1)
                  (masked_whiten's unbiased variance), advantage (c_i - mean) · rsqrt(var +
                  1e-8); `eps` is not used. The per-token value is the undiscounted outcome
                  score: verl's other form, reinforce_plus_plus (no group baseline, the
                  γ-discounted return of the score per token), is not implemented.

    A group whose G rewards are all equal gets exactly 0 from every estimator (verl's
    token-weighted form shifts such a group by -mean/std, a push that says nothing about the
    group's samples). `lengths_PG` [P, G]: response tokens of each sample (what the loss
    trains), needed by reinforce_pp_token only and ignored by the others.

    `mask_P` [P] bool (None: every row): the rows that hold a group; the others are padding
    (a batch of fewer groups padded to a fixed P, so these eager ops keep one shape) and get
    0, and the whitening of reinforce_pp and reinforce_pp_token runs over the real rows'
    samples only: the advantages of the real rows are those of the batch without the padding.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"advantages: unknown group estimator {estimator!r}; valid: "
                         f"{GROUP_ESTIMATORS}")
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
    mask_P = np.ones(r_PG.shape[0], bool) if mask_P is None else np.asarray(mask_P, bool)
    if mask_P.shape != r_PG.shape[:1]:
        raise ValueError(f"advantages: mask_P has shape {mask_P.shape}, rewards_PG "
                         f"{tuple(r_PG.shape)}")
    real_P1 = jnp.asarray(mask_P[:, None])
    informative_P1 = (r_PG.max(axis=1, keepdims=True) > r_PG.min(axis=1, keepdims=True)) & real_P1
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
    # The whitening weighs each real sample one (reinforce_pp) or its tokens (_token).
    if estimator == "reinforce_pp":
        # The batch mean of group-centred values is 0 up to rounding; the constant groups are
        # kept at exactly 0 after the shift.
        mean, var = _weighted_moments(jnp.broadcast_to(real_P1, r_PG.shape), centred_PG)
        return jnp.where(informative_P1, (centred_PG - mean) / (jnp.sqrt(var) + eps), 0.0)
    mean, var = _weighted_moments(_token_counts(lengths_PG, r_PG.shape) * real_P1, centred_PG)
    white_PG = (centred_PG - mean) / jnp.sqrt(var + _WHITEN_VAR_EPS)
    return jnp.where(informative_P1, white_PG, 0.0)


def _weighted_moments(w_PG, x_PG):
    """(mean, unbiased variance) of x with frequency weights w (n = their sum)."""
    w_PG = jnp.asarray(w_PG, jnp.float32)
    n = w_PG.sum()
    mean = jnp.sum(w_PG * x_PG) / n
    return mean, jnp.sum(w_PG * (x_PG - mean) ** 2) / (n - 1.0)


def _token_counts(lengths_PG, shape):
    if lengths_PG is None:
        raise ValueError("advantages: reinforce_pp_token needs lengths_PG (the response tokens "
                         "of each sample) to weigh the samples by their tokens")
    w_PG = np.asarray(lengths_PG, np.float32)  # host counts: the checks below need values
    if w_PG.shape != tuple(shape):
        raise ValueError(f"advantages: lengths_PG has shape {w_PG.shape}, rewards_PG "
                         f"{tuple(shape)}")
    total = float(w_PG.sum())
    if total < 2:
        raise ValueError(f"advantages: reinforce_pp_token whitens over tokens and needs at "
                         f"least 2 response tokens in the batch, got {total:g}")
    return jnp.asarray(w_PG)


# The built-ins, registered by name (`lrl.rl.registry`): each asks for the inputs it reads.
@registry.register_estimator("grpo")
def grpo(rewards_PG, *, eps=1e-6, mask_P=None):
    return group_advantages(rewards_PG, "grpo", eps, mask_P=mask_P)


@registry.register_estimator("dr_grpo")
def dr_grpo(rewards_PG, *, mask_P=None):
    return group_advantages(rewards_PG, "dr_grpo", mask_P=mask_P)


@registry.register_estimator("rloo")
def rloo(rewards_PG, *, mask_P=None):
    return group_advantages(rewards_PG, "rloo", mask_P=mask_P)


@registry.register_estimator("reinforce_pp")
def reinforce_pp(rewards_PG, *, eps=1e-6, mask_P=None):
    return group_advantages(rewards_PG, "reinforce_pp", eps, mask_P=mask_P)


@registry.register_estimator("reinforce_pp_token")
def reinforce_pp_token(rewards_PG, *, lengths_PG=None, mask_P=None):
    return group_advantages(rewards_PG, "reinforce_pp_token", lengths_PG=lengths_PG,
                            mask_P=mask_P)


registry.register_estimator("remax")(remax)
registry.register_estimator("gae", kind="token", needs_critic=True)(gae)
