"""Scorer of the synthetic tasks of `lrl.data.synthetic` (key-value retrieval, arithmetic).

Their documented answer format: a completion is correct iff the text inside its LAST
\\boxed{...} equals the answer exactly after stripping surrounding whitespace (answers are plain
ASCII digit strings). The scorer is exactly that, and deliberately no looser: "04821", "4,821"
or an unboxed "Answer: 4821" score 0, because the SFT warm start teaches the boxed form and a
lenient scorer would reward a format the task does not ask for.
"""
from __future__ import annotations

from lrl.rewards.math import last_boxed


def synthetic_reward(completion: str, answer: str, **meta) -> float:
    """1.0 if the last \\boxed{} of the completion holds exactly `answer`, else 0.0."""
    gold = str(answer).strip()
    if not gold:
        raise ValueError("synthetic reward: the reference answer is empty")
    boxed = last_boxed(completion)
    return float(boxed is not None and boxed.strip() == gold)
