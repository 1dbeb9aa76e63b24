"""What differs between text and video GRPO, as one small seam chosen by `config.task`.

A task turns its data into `Prompt`s for the rollout, says what an update row carries beyond
text and what the forward needs besides tokens; the loop and the host step (`lrl.collect`,
`lrl.collect_partial`, `lrl.grpo`) are the same for every task:

    task = tasks.build(opts, workdir, mesh)
    it = task.prompts("train")                 # next(it) -> a raw batch; get/set_state, stats
    prompts, m = task.prepare(params, next(it))   # -> [Prompt], metrics
    rows, extra = task.update_inputs(rows, layout, sample_prompts)  # extra: the forward's
    update_fn = make_update_fn(..., hidden=task.hidden, extra_keys=task.extra_keys)

Every task has: `tokenizer`, `model_cfg` (the text decoder's `ModelConfig`), `hidden` and
`extra_keys` (see `lrl.rl.update`), `multimodal` (its prompts carry input embeddings: the
rollout engine compiles its prefill for those), `initial_params()`, `prompts(split)`,
`eval_batches()`, `prepare(params, raw)`, `update_inputs(...)`, and `state()` /
`restore(state)` for what it keeps across steps (saved in the checkpoint). The text task also builds SFT batches.

P prompts · G samples per prompt · T positions · D model width.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as the rollout and the update see it."""
    ids: np.ndarray                       # [T] int32 token ids
    answer: str                           # what the reward compares against
    meta: dict                            # passed to the reward functions (task, source, ...)
    text: str                             # the prompt as a person reads it (samples.jsonl)
    embeds: Optional[Any] = None          # [T', D] input embeddings (multimodal prompts),
                                          # T' >= T: rows past T (a length bucket) unread
    positions: Optional[np.ndarray] = None  # [3, T] M-RoPE positions (multimodal prompts)
    visual: Optional[Any] = None          # the task's per-prompt data for its update rows


def prompt_to_state(p: Prompt) -> dict:
    """A text prompt as JSON (a partial rollout's carried group, saved with the checkpoint).
    What would not come back the same (multimodal inputs, meta that is not plain JSON) is
    refused here, at the save, rather than changed silently."""
    for name in ("embeds", "positions", "visual"):
        if getattr(p, name) is not None:
            raise ValueError(f"a carried prompt has {name}: only text prompts can be saved "
                             "with the checkpoint")
    d = {"answer": p.answer, "meta": p.meta, "text": p.text}
    try:
        same = json.loads(json.dumps(d)) == d
    except (TypeError, ValueError) as e:
        raise ValueError(f"a carried prompt's {d!r} is not JSON: {e}") from e
    if not same:
        raise ValueError(f"a carried prompt's {d!r} would not come back the same from JSON "
                         "(tuples, non-string keys?)")
    return {"ids": np.asarray(p.ids).tolist(), **d}


def prompt_from_state(d: dict) -> Prompt:
    return Prompt(np.asarray(d["ids"], np.int32), d["answer"], d["meta"], d["text"])


def build(opts, workdir: str, mesh):
    """The configured task, with its tokenizer and model config built."""
    if opts.task == "video":
        from lrl.tasks.video import VideoTask
        return VideoTask(opts, workdir, mesh)
    from lrl.tasks.text import TextTask
    return TextTask(opts, workdir, mesh)
