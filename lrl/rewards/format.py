"""Format reward: a reasoning block `<think>…</think>` followed by a non-empty answer.

Chat templates of reasoning models (Qwen3, R1 distills) often open `<think>` inside the
prompt, so the completion starts mid-thought; `require_open=False` accepts that.
"""
from __future__ import annotations

from lrl.rewards.math import last_boxed

OPEN, CLOSE = "<think>", "</think>"


def format_reward(completion: str, answer: str, *, require_boxed: bool = False,
                  require_open: bool = True, **meta) -> float:
    """1.0 if the completion is `<think>…</think>` then a non-empty answer, else 0.0.

    Exactly one think block; `require_boxed` also asks the answer part for a closed, non-empty
    \\boxed{}; `require_open=False` lets the opening tag be missing (opened by the template).
    `answer` (the reference) is not used.
    """
    text = completion.strip()
    n_open, n_close = text.count(OPEN), text.count(CLOSE)
    if n_close != 1 or n_open > 1:
        return 0.0
    if n_open == 1:
        if not text.startswith(OPEN):
            return 0.0
    elif require_open:
        return 0.0
    tail = text.split(CLOSE, 1)[1].strip()
    if not tail:
        return 0.0
    if require_boxed:
        boxed = last_boxed(tail)
        if boxed is None or not boxed.strip():
            return 0.0
    return 1.0
