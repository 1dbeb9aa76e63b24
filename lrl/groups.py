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
    # [P*G] int8 arrays, one per completion: 1 on tokens the model sampled, 0 on a multi-turn
    # trajectory's observation tokens (attended, never trained); () = every token sampled
    masks: tuple = ()
    # [P*G] dicts of a multi-turn trajectory's own numbers (`lrl.trajectories`); () = none
    trajectories: tuple = ()

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
                      None if self.baseline_P is None else self.baseline_P[keep],
                      pick(self.masks), pick(self.trajectories))

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
                      None if any(b is None for b in baselines) else np.concatenate(baselines),
                      _cat_optional(parts, "masks"), _cat_optional(parts, "trajectories"))

    def model_mask(self, i: int) -> np.ndarray:
        """[len(completions[i])] float32: 1 on the tokens sample `i`'s model sampled."""
        if not self.masks:
            return np.ones(len(self.completions[i]), np.float32)
        return np.asarray(self.masks[i], np.float32)

    def model_tokens(self) -> np.ndarray:
        """[P*G] how many tokens of each completion the model sampled (what the loss trains)."""
        if not self.masks:
            return np.array([len(c) for c in self.completions], np.int64)
        return np.array([int(np.asarray(m).sum()) for m in self.masks], np.int64)

    def sample_ages(self) -> np.ndarray:
        """[P*G] each sample's age in policy versions (0 when none was given)."""
        if self.ages is None:
            return np.zeros(len(self.completions), np.int32)
        return np.asarray(self.ages)


def _cat_optional(parts: list[Groups], name: str) -> tuple:
    """A per-sample tuple that some parts may leave empty (single-turn groups): joined, with
    the empty parts' filled in (all-ones masks; empty trajectory records)."""
    if all(not getattr(g, name) for g in parts):
        return ()
    fill = {"masks": lambda g: tuple(np.ones(len(c), np.int8) for c in g.completions),
            "trajectories": lambda g: ({},) * len(g.completions)}[name]
    return tuple(x for g in parts for x in (getattr(g, name) or fill(g)))
