"""Scorer of the synthetic video task (`lrl.data.video_task`).

Answers are a colour name ("red") for `video_direction` or a count ("3") for `video_count`.
A completion is correct iff the text inside its LAST \\boxed{...} equals the answer after
stripping surrounding whitespace, ignoring case (so "\\boxed{Red}" names red); nothing else
is loosened: "\\boxed{red shape}", "\\boxed{03}" or an unboxed "red" score 0.
"""
from __future__ import annotations

from lrl.rewards.math import last_boxed


def video_reward(completion: str, answer: str, **meta) -> float:
    """1.0 if the last \\boxed{} of the completion holds `answer` (case-insensitive), else 0.0."""
    gold = str(answer).strip().casefold()
    if not gold:
        raise ValueError("video reward: the reference answer is empty")
    boxed = last_boxed(completion)
    return float(boxed is not None and boxed.strip().casefold() == gold)
