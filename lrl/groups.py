"""`Groups`: P prompts with G scored samples each, what a step's collection hands its learning.
The collection (`lrl.collect`, `lrl.collect_partial`) builds them, the learning
(`lrl.grpo.learn`) and the one-step-off pipeline (`lrl.pipeline`) read them; like `Setup`
(`lrl.step_setup`) it is a type of the step that imports nothing of it.

P prompts · G samples per prompt.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Groups:
    """P prompts with G completions each (row-major: sample g of prompt p is p*G + g)."""
    prompts: tuple            # [P] Prompt
    completions: tuple        # [P*G] int32 arrays (ending with EOS when it finished)
    logps: tuple              # [P*G] float32 arrays: sampler log-probs of those tokens
    group_size: int
    truncated: np.ndarray     # [P*G] bool: hit max_new_tokens
    texts: tuple = ()         # [P*G] decoded completions (after `score`)
    rewards_PG: Optional[np.ndarray] = None
    # [P*G] policy versions between the parameters that sampled each completion and those
    # that train on it (the staleness weight reads it); None: all 0, a synchronous step
    ages: Optional[np.ndarray] = None
    # [P] the reward of one greedy sample per prompt, when the estimator asks for a baseline
    # (ReMax; `with_baseline`): scored, never trained on
    baseline_P: Optional[np.ndarray] = None

    @property
    def P(self) -> int:
        return len(self.prompts)

    def take(self, keep_P: np.ndarray) -> "Groups":
        G = self.group_size
        keep = np.flatnonzero(keep_P)
        flat = [p * G + g for p in keep for g in range(G)]
        pick = lambda xs: tuple(xs[i] for i in flat) if len(xs) else ()  # noqa: E731
        return Groups(tuple(self.prompts[p] for p in keep), pick(self.completions),
                      pick(self.logps), G, self.truncated[flat], pick(self.texts),
                      None if self.rewards_PG is None else self.rewards_PG[keep],
                      None if self.ages is None else self.ages[flat],
                      None if self.baseline_P is None else self.baseline_P[keep])

    @staticmethod
    def concat(parts: list["Groups"]) -> "Groups":
        cat = lambda name: tuple(x for g in parts for x in getattr(g, name))  # noqa: E731
        rewards = [g.rewards_PG for g in parts]
        ages = None if all(g.ages is None for g in parts) else np.concatenate(
            [g.sample_ages() for g in parts])
        baselines = [g.baseline_P for g in parts]
        return Groups(cat("prompts"), cat("completions"), cat("logps"), parts[0].group_size,
                      np.concatenate([g.truncated for g in parts]), cat("texts"),
                      None if any(r is None for r in rewards) else np.concatenate(rewards),
                      ages,
                      None if any(b is None for b in baselines) else np.concatenate(baselines))

    def sample_ages(self) -> np.ndarray:
        """[P*G] each sample's age in policy versions (0 when none was given)."""
        if self.ages is None:
            return np.zeros(len(self.completions), np.int32)
        return np.asarray(self.ages)
