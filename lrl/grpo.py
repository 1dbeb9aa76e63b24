"""The host-side half of a GRPO step: sample G completions per prompt, score them, shape and
filter the rewards, turn them into advantages and pack everything into update rows.

Every function takes plain arrays and lists and returns the same, so each stage of the step
can be read, tested and swapped alone. The device-side half is `lrl.rl.update`.

P prompts · G samples per prompt · B packed rows · T positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lrl import rl
from lrl import rollout
from lrl.data import packing


@dataclass
class Groups:
    """P prompts with G completions each (row-major: sample g of prompt p is p*G + g)."""
    prompt_ids: list            # [P] int32 arrays
    answers: list               # [P]
    metas: list                 # [P] dicts
    completions: list           # [P*G] int32 arrays (ending with EOS when it finished)
    logps: list                 # [P*G] float32 arrays: sampler log-probs of those tokens
    group_size: int
    texts: list = field(default_factory=list)        # [P*G] decoded completions
    rewards_PG: np.ndarray | None = None
    truncated: np.ndarray | None = None              # [P*G] bool: hit max_new_tokens

    @property
    def P(self) -> int:
        return len(self.prompt_ids)

    def take(self, keep_P: np.ndarray) -> "Groups":
        G = self.group_size
        flat = [p * G + g for p in np.flatnonzero(keep_P) for g in range(G)]
        pick = lambda xs: [xs[i] for i in flat]  # noqa: E731
        return Groups([self.prompt_ids[p] for p in np.flatnonzero(keep_P)],
                      [self.answers[p] for p in np.flatnonzero(keep_P)],
                      [self.metas[p] for p in np.flatnonzero(keep_P)],
                      pick(self.completions), pick(self.logps), G, pick(self.texts),
                      self.rewards_PG[keep_P], self.truncated[flat])

    @staticmethod
    def concat(parts: list["Groups"]) -> "Groups":
        first = parts[0]
        cat = lambda name: [x for g in parts for x in getattr(g, name)]  # noqa: E731
        return Groups(cat("prompt_ids"), cat("answers"), cat("metas"), cat("completions"),
                      cat("logps"), first.group_size, cat("texts"),
                      np.concatenate([g.rewards_PG for g in parts]),
                      np.concatenate([g.truncated for g in parts]))


def sample(model_cfg, params, batch, *, group_size: int, rl_cfg, rollout_cfg, eos_ids,
           seed: int, mesh=None, temperature: float | None = None, stats=None) -> Groups:
    """Rollout: G samples of every prompt of a data batch."""
    outs = rollout.generate(
        model_cfg, params, batch["prompt_ids"], max_new_tokens=rl_cfg.max_new_tokens,
        num_samples=group_size,
        temperature=rl_cfg.temperature if temperature is None else temperature,
        top_k=rl_cfg.top_k, top_p=rl_cfg.top_p, eos_ids=tuple(eos_ids), seed=seed,
        page_size=rollout_cfg.page_size, max_slots=rollout_cfg.max_slots,
        pool_tokens=rollout_cfg.pool_tokens or None, mesh=mesh, stats=stats)
    completions = [np.asarray(ids, np.int32) for per_prompt in outs for ids, _ in per_prompt]
    logps = [np.asarray(lp, np.float32) for per_prompt in outs for _, lp in per_prompt]
    eos = set(int(e) for e in eos_ids)
    truncated = np.array([len(c) >= rl_cfg.max_new_tokens and (len(c) == 0 or int(c[-1]) not in eos)
                          for c in completions])
    metas = [dict(m or {}, task=t) for m, t in zip(batch["metadata"], batch["task"])]
    return Groups(list(batch["prompt_ids"]), list(batch["answer"]), metas, completions, logps,
                  group_size, truncated=truncated)


def score(groups: Groups, pool, tokenizer) -> dict:
    """Rewards [P, G] from the host reward functions; failures score 0 and are counted."""
    groups.texts = [tokenizer.decode(c, skip_special_tokens=True) for c in groups.completions]
    G = groups.group_size
    items = [(text, str(groups.answers[i // G]), groups.metas[i // G])
             for i, text in enumerate(groups.texts)]
    rewards, stats = pool.score(items)
    groups.rewards_PG = np.asarray(rewards, np.float32).reshape(groups.P, G)
    return {f"reward/{k}": v for k, v in stats.items() if not k.startswith("term_mean")} | {
        f"reward/{k}": v for k, v in stats.items() if k.startswith("term_mean")}


def overlong_shaping(groups: Groups, rl_cfg) -> np.ndarray:
    """DAPO's overlong handling. Returns a [P*G] loss weight (0 drops a sample's tokens):
    "mask" drops truncated samples from the loss; "penalty" subtracts a penalty that ramps
    from 0 to `overlong_penalty` over the last `overlong_buffer` tokens of the limit."""
    weight = np.ones(len(groups.completions), np.float32)
    if rl_cfg.overlong == "none":
        return weight
    if rl_cfg.overlong == "mask":
        weight[groups.truncated] = 0.0
        return weight
    if rl_cfg.overlong == "penalty":
        lengths = np.array([len(c) for c in groups.completions], np.float32)
        start = rl_cfg.max_new_tokens - rl_cfg.overlong_buffer
        ramp = np.clip((lengths - start) / max(rl_cfg.overlong_buffer, 1), 0.0, 1.0)
        groups.rewards_PG = groups.rewards_PG - (rl_cfg.overlong_penalty * ramp).reshape(
            groups.rewards_PG.shape).astype(np.float32)
        return weight
    raise ValueError(f"rl.overlong={rl_cfg.overlong!r}; choose none, mask or penalty")


def informative(rewards_PG: np.ndarray) -> np.ndarray:
    """DAPO dynamic sampling: a group whose rewards are all equal has zero advantage
    everywhere and teaches nothing."""
    return rewards_PG.max(axis=1) > rewards_PG.min(axis=1)


def update_rows(groups: Groups, adv_PG: np.ndarray, weight: np.ndarray, *, row_len: int,
                rows_multiple: int, use_sampler_logp: bool, min_rows: int = 0):
    """Packs prompt+completion rows for the update; the loss mask covers completion tokens
    (times the overlong weight). Returns (batch dict of [B, T] arrays, layout)."""
    G = groups.group_size
    prompts = [groups.prompt_ids[i // G] for i in range(len(groups.completions))]
    token_values = {"completion_weight": [np.full(len(c), w, np.float32)
                                          for c, w in zip(groups.completions, weight)]}
    if use_sampler_logp:
        token_values["old_logp"] = groups.logps
    batch, layout = packing.pack(prompts, groups.completions, row_len,
                                 seq_values={"advantages": adv_PG.reshape(-1)},
                                 token_values=token_values, rows_multiple=rows_multiple,
                                 min_rows=min_rows, truncate=True)
    batch["loss_mask"] = batch["loss_mask"] * batch.pop("completion_weight")
    return batch, layout


def rollout_metrics(groups: Groups, eos_ids) -> dict:
    lengths = np.array([len(c) for c in groups.completions], np.float32)
    r = groups.rewards_PG
    return {
        "reward/mean": float(r.mean()), "reward/std": float(r.std()),
        "reward/max": float(r.max()), "reward/min": float(r.min()),
        "reward/group_std_mean": float(r.std(axis=1).mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(groups.truncated.mean()),
    }


def pass_at_k(correct_PG: np.ndarray, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n >= k samples per prompt."""
    n = correct_PG.shape[1]
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    c = correct_PG.sum(axis=1)
    vals = [1.0 if n - ci < k else 1.0 - math.comb(n - ci, k) / math.comb(n, k) for ci in c]
    return float(np.mean(vals))


def advantages(groups: Groups, estimator: str) -> np.ndarray:
    # The completion tokens are what the loss trains (reinforce_pp_token weighs by them).
    lengths_PG = np.array([len(c) for c in groups.completions]).reshape(groups.P, -1)
    return np.asarray(rl.advantages(groups.rewards_PG, estimator=estimator,
                                    lengths_PG=lengths_PG), np.float32)
