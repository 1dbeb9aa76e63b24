"""Observation token ids from the model's chat template, without re-tokenising the history.

After a model turn, the trajectory's tokens are exactly what was sampled; an observation
must be appended as the ids the chat template would put after that turn: the end of the
assistant message (unless the model sampled it), the new tool / user messages, and the next
assistant header. `observation_ids` gets them as a difference of two renderings: the
template over a stand-in conversation that ends with an assistant message holding a unique
marker, with and without the new messages; the ids to append are the tokens of what follows
the marker. The real history is never rendered again, so a template that rewrites earlier
turns (Qwen3's drops earlier `<think>` blocks; it renders the last assistant message with an
empty think block, so "without" is not even a prefix of "with") cannot change the tokens of
the trajectory, and earlier turns are never re-tokenised.

The model's own end-of-turn token stands in for the template's: when the turn ended with it
(`last_token` equals the first id after the marker, or both are end ids, e.g. Llama 3's
`<|eom_id|>` for the template's `<|eot_id|>`), that id is dropped; when the model stopped on
something else (Qwen's `</tool_call>`, a turn_end_id), it is kept and closes the turn.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

_MARKER = "\u2063lrl-turn-end-marker\u2063"
# A stand-in conversation: templates need a user message (Qwen3's raises without one).
_STAND_IN = ({"role": "user", "content": "."}, {"role": "assistant", "content": _MARKER})
_CLOSE: dict = {}   # (template, bos, eos, kwargs) -> how it closes an assistant turn


def render_text(tokenizer, messages: Sequence[Mapping], *, chat_template: Optional[str] = None,
                **template_kwargs) -> str:
    """The text the template puts after an assistant turn to add `messages` and open the
    next assistant turn (its end-of-turn text first)."""
    if not messages:
        raise ValueError("observation_ids: no messages to render")
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(f"observation_ids: a message must be {{'role': ..., 'content': "
                             f"str}}, got {m!r}")
    text = tokenizer.apply_chat_template(
        [*_STAND_IN, *messages], tokenize=False, add_generation_prompt=True,
        chat_template=chat_template, **template_kwargs)
    at = text.find(_MARKER)
    if at < 0 or text.find(_MARKER, at + 1) >= 0:
        raise ValueError("observation_ids: the chat template does not render an assistant "
                         "message's content once, verbatim; cannot place the observation")
    suffix = text[at + len(_MARKER):]
    # The end-of-turn text of the assistant message as the template closes it, for the
    # check below: the observation must come after it, or the template lost the messages.
    # (what the text depends on: the template and the tokens it may name, not the tokenizer)
    cache_key = (chat_template or getattr(tokenizer, "chat_template", None),
                 getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None),
                 repr(sorted(template_kwargs.items())))
    close = _CLOSE.get(cache_key)
    if close is None:
        without = tokenizer.apply_chat_template(
            list(_STAND_IN), tokenize=False, add_generation_prompt=False,
            chat_template=chat_template, **template_kwargs)
        close = _CLOSE[cache_key] = without[without.find(_MARKER) + len(_MARKER):]
    if close and not suffix.startswith(close) and not suffix.startswith(close.rstrip()):
        raise ValueError(f"observation_ids: the template closes the assistant turn with "
                         f"{close!r} alone but with {suffix[:len(close)]!r} when messages "
                         "follow; cannot tell where the observation starts")
    return suffix


def observation_ids(tokenizer, messages: Sequence[Mapping], *, last_token: Optional[int] = None,
                    end_ids: Sequence[int] = (), chat_template: Optional[str] = None,
                    **template_kwargs) -> list[int]:
    """Token ids to append after a model turn that ended with `last_token` so that the
    trajectory continues with `messages` (e.g. [{"role": "tool", "content": "42"}]) and a new
    assistant header; see the module docstring. `end_ids`: the model's end-of-turn ids
    (eos, Llama's <|eom_id|>), any of which stands in for the template's closing id."""
    suffix = render_text(tokenizer, messages, chat_template=chat_template, **template_kwargs)
    ids = list(tokenizer.encode(suffix, add_special_tokens=False))
    if ids and last_token is not None and (
            ids[0] == last_token or (last_token in end_ids and ids[0] in end_ids)):
        ids = ids[1:]
    if not ids:
        raise ValueError(f"observation_ids: the template renders {messages!r} as no tokens")
    return ids
