"""Verifiable rewards: a registry of `fn(completion, answer, **meta) -> float` selected by config,
weighted combinations, and a process pool that scores with per-call timeouts.

    fn = lrl.rewards.get("math")                                  # one reward
    fn = lrl.rewards.combine([("math", 1.0), ("format", 0.1)])    # weighted sum
    pool = lrl.rewards.RewardPool("math:1,format:0.1", num_workers=8, timeout_s=10)
    rewards, stats = pool.score([(completion, answer, meta), ...])
"""
from lrl.rewards import format, match, math, model, synthetic, video
from lrl.rewards.pool import RewardFailure, RewardPool
from lrl.rewards.registry import Term, combine, get, names, parse_spec, register, terms_of

# The built-in rewards, registered here by name (worker processes import this package, so
# they find the same names). Their modules only define the functions.
register("math")(math.math_reward)
register("format")(format.format_reward)
register("exact")(match.exact_reward)
register("regex")(match.regex_reward)
register("choice")(match.choice_reward)
register("synthetic")(synthetic.synthetic_reward)
register("video")(video.video_reward)
# The reward model's term: scored on the mesh by `model.ModelRewardPool`, not by a worker.
register(model.MODEL_TERM)(model.model_reward)

__all__ = ["RewardFailure", "RewardPool", "Term", "combine", "get", "names", "parse_spec", "register", "terms_of"]
