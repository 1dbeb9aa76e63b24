"""Verifiable rewards: a registry of `fn(completion, answer, **meta) -> float` selected by config,
weighted combinations, and a process pool that scores with per-call timeouts.

    fn = lrl.rewards.get("math")                                  # one reward
    fn = lrl.rewards.combine([("math", 1.0), ("format", 0.1)])    # weighted sum
    pool = lrl.rewards.RewardPool("math:1,format:0.1", num_workers=8, timeout_s=10)
    rewards, stats = pool.score([(completion, answer, meta), ...])
"""
from lrl.rewards.pool import RewardFailure, RewardPool
from lrl.rewards.registry import Term, combine, get, names, parse_spec, register, terms_of

__all__ = ["RewardFailure", "RewardPool", "Term", "combine", "get", "names", "parse_spec", "register", "terms_of"]
