"""Synthetic verifiable tasks for the default experiment: they need nothing downloaded, their
answers are checked exactly, and key-value retrieval needs the whole (long) context.

Tasks (every example is a pure function of `(seed, index)`, so any index can be read in any
order — what grain's random access wants):

* ``kv_retrieval`` — the prompt lists `n` pairs ``key: value`` (keys: `key_len` lowercase
  letters, distinct; values: `value_len` digits, first digit non-zero) and asks for the value
  of one key; `n` is uniform in ``[min_pairs, num_pairs]``. Answer: that value, e.g. ``4821``.
* ``arithmetic`` — a chain of `m` small non-negative integers (``0..max_operand``) joined by
  ``+`` and ``-``, with `m` uniform in ``[min_terms, num_terms]``; every running total stays
  non-negative. Answer: the result in decimal, e.g. ``17``.
* ``tool_lookup`` — a multi-turn tool task: the prompt names one key of a table of `n` pairs
  (as ``kv_retrieval``'s) that it does not show; the table is in the record's metadata
  (``metadata["table"]``), where the ``lookup`` tool (`lrl.envs`) reads it. Without the tool
  the answer is a guess. Answer: the key's value. Its SFT demonstration is the whole
  conversation (`tool_conversation`): a tool call, the tool's response, the boxed answer.

Example record (`make_example`)::

    {"messages": [{"role": "user", "content": prompt}], "prompt": prompt,
     "answer": "4821", "task": "kv_retrieval", "metadata": {...}}

ANSWER FORMAT (what the scorer in lrl/rewards/ checks):
  * A completion is correct iff the text inside its LAST ``\\boxed{...}`` equals ``answer``
    exactly after stripping surrounding whitespace (both are plain ASCII strings: digits only
    for both tasks, no sign, no leading zeros, no thousands separators).
  * The well-formed shape, which the SFT warm start teaches, is::

        <think>{steps}</think>\\n\\boxed{answer}

    where for kv_retrieval `{steps}` is the matching line, ``qzv: 4821``, and for arithmetic
    one line per operation, ``3 + 5 = 8\\n8 - 2 = 6``. With ``think=False`` the response is
    just ``\\boxed{answer}``. Nothing follows the box (the chat turn then ends with the EOS
    token ``<|im_end|>``, which is not part of the response text).
  * Every prompt ends with the instruction ``Answer with \\boxed{...}.`` so real models know
    the format too.

TOOL FORMAT (``tool_lookup``; Qwen2.5's, as `lrl.envs` parses it): the first model turn is
``<tool_call>{"name": "lookup", "arguments": {"key": "qz"}}</tool_call>`` and ends with the
turn's EOS; the observation is the chat template's tool message, ``<|im_start|>user\n
<tool_response>\n482\n</tool_response><|im_end|>\n<|im_start|>assistant\n`` (`TOOL_TEMPLATE`
of `lrl.data.tokenizer`); the second model turn is the boxed answer, ``\\boxed{482}`` (its SFT
demonstrations do not think: `tool_conversation`).

`sft_example` gives ``{"messages", "response", "answer", "task", "metadata"}`` records for the
warm start; `synthetic_corpus` gives texts to train the local tokenizer on.
"""
from __future__ import annotations

import re
import zlib
from typing import Any, Callable, Iterable

import numpy as np

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_MARKUP = re.compile(r"</?(?:tool_call|tool_response|think)>")


def _rng(task: str, seed: int, index: int) -> np.random.Generator:
    if index < 0:
        raise IndexError(f"synthetic {task}: index {index} is negative")
    # The task name is mixed in so two tasks with one seed are independent streams.
    salt = zlib.crc32(task.encode())
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(index), salt]))


def _check_range(task: str, name_lo: str, lo: int, name_hi: str, hi: int, floor: int) -> None:
    if not floor <= lo <= hi:
        raise ValueError(f"synthetic {task}: need {floor} <= {name_lo} ({lo}) <= {name_hi} ({hi})")


def kv_retrieval(seed: int, index: int, *, num_pairs: int = 32, min_pairs: int | None = None,
                 key_len: int = 3, value_len: int = 4) -> dict[str, Any]:
    """Example `index` of the key-value retrieval task (see the module docstring)."""
    min_pairs = num_pairs if min_pairs is None else min_pairs
    _check_range("kv_retrieval", "min_pairs", min_pairs, "num_pairs", num_pairs, 1)
    if key_len < 1 or value_len < 1:
        raise ValueError(f"synthetic kv_retrieval: key_len={key_len} and value_len={value_len} "
                         "must be >= 1")
    if num_pairs > 26 ** key_len // 2:  # keep rejection sampling of distinct keys cheap
        raise ValueError(f"synthetic kv_retrieval: num_pairs={num_pairs} is too many for "
                         f"key_len={key_len} (at most {26 ** key_len // 2})")
    rng = _rng("kv_retrieval", seed, index)
    n = int(rng.integers(min_pairs, num_pairs + 1))
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < n:
        key = "".join(_LETTERS[i] for i in rng.integers(0, 26, key_len))
        if key not in seen:
            seen.add(key)
            keys.append(key)
    first = rng.integers(1, 10, n)
    rest = rng.integers(0, 10, (n, value_len - 1))
    values = ["".join(map(str, [f, *r])) for f, r in zip(first, rest)]
    position = int(rng.integers(0, n))
    lines = "\n".join(f"{k}: {v}" for k, v in zip(keys, values))
    prompt = (f"Here are {n} key-value pairs.\n{lines}\n"
              f"What is the value of key {keys[position]}? Answer with \\boxed{{...}}.")
    meta = {"seed": int(seed), "index": int(index), "num_pairs": n,
            "key": keys[position], "position": position}
    return _record("kv_retrieval", prompt, values[position], meta,
                   steps=f"{keys[position]}: {values[position]}")


def arithmetic(seed: int, index: int, *, num_terms: int = 4, min_terms: int | None = None,
               max_operand: int = 9) -> dict[str, Any]:
    """Example `index` of the chained addition/subtraction task (see the module docstring)."""
    min_terms = num_terms if min_terms is None else min_terms
    _check_range("arithmetic", "min_terms", min_terms, "num_terms", num_terms, 2)
    if max_operand < 1:
        raise ValueError(f"synthetic arithmetic: max_operand={max_operand} must be >= 1")
    rng = _rng("arithmetic", seed, index)
    m = int(rng.integers(min_terms, num_terms + 1))
    total = int(rng.integers(0, max_operand + 1))
    expr, steps = [str(total)], []
    for _ in range(m - 1):
        x = int(rng.integers(0, max_operand + 1))
        # Subtract only when the total stays non-negative: answers never carry a sign.
        op = "-" if rng.random() < 0.5 and x <= total else "+"
        new = total - x if op == "-" else total + x
        expr.append(f"{op} {x}")
        steps.append(f"{total} {op} {x} = {new}")
        total = new
    prompt = f"Compute {' '.join(expr)}. Answer with \\boxed{{...}}."
    meta = {"seed": int(seed), "index": int(index), "num_terms": m}
    return _record("arithmetic", prompt, str(total), meta, steps="\n".join(steps))


def tool_lookup(seed: int, index: int, *, num_pairs: int = 64, min_pairs: int | None = None,
                key_len: int = 2, value_len: int = 3) -> dict[str, Any]:
    """Example `index` of the lookup tool task (see the module docstring): `kv_retrieval`'s
    table, kept out of the prompt."""
    ex = kv_retrieval(seed, index, num_pairs=num_pairs, min_pairs=min_pairs, key_len=key_len,
                      value_len=value_len)
    lines = ex["prompt"].split("\n")[1:-1]
    table = dict(line.split(": ") for line in lines)
    key = ex["metadata"]["key"]
    prompt = (f"Look up key {key} with the lookup tool. Answer with \\boxed{{...}}.")
    meta = {k: v for k, v in ex["metadata"].items() if k != "steps"}
    meta["table"] = table
    return _record("tool_lookup", prompt, ex["answer"], meta, steps=f"{key}: {ex['answer']}")


# The tool-call markup of Qwen2.5 / Qwen3 (one token each in the embedded tokenizer when the
# task uses tools: `lrl.data.tokenizer.TOOL_TOKENS`).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# The tasks whose answers need a tool: their SFT responses are whole conversations.
TOOL_TASKS = ("tool_lookup",)


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the model writes it (compact JSON, keys in the given order)."""
    import json
    return (TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments})
            + TOOL_CALL_CLOSE)


def tool_conversation(example: dict[str, Any], think: bool = True,
                      boxed: str | None = None, call: bool = True) -> list[dict[str, str]]:
    """The assistant / tool messages after the prompt of a tool task's demonstration: a
    ``lookup`` call, the tool's answer, the boxed answer (boxing `boxed` when given). With
    `call` False: the boxed answer alone (a demonstration that skips the tool). With `think`
    the final turn first repeats the line it read (``<think>qz: 482</think>``); the tool
    task's SFT leaves it out: the tool's response is the reasoning, and a tiny model learns
    one copy of the value faster than two."""
    final = sft_response(example, think=think, boxed=boxed)
    if not call:
        return [{"role": "assistant", "content": final}]
    key = example["metadata"]["key"]
    return [{"role": "assistant", "content": tool_call_text("lookup", {"key": key})},
            {"role": "tool", "content": example["metadata"]["table"][key]},
            {"role": "assistant", "content": final}]


def turn_segments(turns: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The SFT response of a tool task's conversation (`render_turns`) as (text, trained)
    pieces: the model's turns with the end-of-turn token it samples are trained; what the
    environment appends (the end of that line, the tool's message, the next assistant
    header: the ids `lrl.envs.observation_ids` hands the rollout) is not, as GRPO leaves it
    untrained too. Every cut is at a special token, so the pieces tokenize as the whole."""
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(turns):
        if m["role"] == "assistant":
            if i:
                out.append(("<|im_start|>assistant\n", False))
            out.append((m["content"] + ("<|im_end|>" if i + 1 < len(turns) else ""), True))
            if i + 1 < len(turns):
                out.append(("\n", False))
        elif m["role"] == "tool":
            out.append((f"<|im_start|>user\n{TOOL_RESPONSE_OPEN}\n{m['content']}\n"
                        f"{TOOL_RESPONSE_CLOSE}<|im_end|>\n", False))
        else:
            raise ValueError(f"render_turns: message {i} has role {m['role']!r}; "
                             "expected assistant or tool")
    return out


def render_turns(turns: list[dict[str, str]]) -> str:
    """The text after the prompt's generation header of a conversation's later messages, in
    the tool template's ChatML (`lrl.data.tokenizer.TOOL_TEMPLATE`): what the SFT response
    of a tool task is. The final EOS is left to the SFT tokenizer, as for any response."""
    return "".join(text for text, _ in turn_segments(turns))


def _record(task: str, prompt: str, answer: str, meta: dict, steps: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "prompt": prompt,
            "answer": answer, "task": task, "metadata": {**meta, "steps": steps}}


TASKS: dict[str, Callable[..., dict[str, Any]]] = {
    "kv_retrieval": kv_retrieval,
    "arithmetic": arithmetic,
    "tool_lookup": tool_lookup,
}


def make_example(task: str, seed: int, index: int, **task_kwargs) -> dict[str, Any]:
    """Example `index` of `task` ("kv_retrieval" or "arithmetic") under `seed`."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}")
    return TASKS[task](seed, index, **task_kwargs)


def sft_response(example: dict[str, Any], think: bool = True, boxed: str | None = None) -> str:
    """The target completion of `example` in the documented answer format (boxing `boxed`
    instead of the answer when given)."""
    box = f"\\boxed{{{example['answer'] if boxed is None else boxed}}}"
    if not think:
        return box
    return f"<think>{example['metadata']['steps']}</think>\n{box}"


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
    """A plausible wrong answer: an integer moved by 1 to 3 (kept non-negative), any other
    string with one character changed (a letter for a letter, a digit for a digit)."""
    if answer.isdigit() and len(answer) < 6:
        value = int(answer)
        deltas = [d for d in (-3, -2, -1, 1, 2, 3) if value + d >= 0]
        return str(value + int(rng.choice(deltas)))
    i = int(rng.integers(len(answer)))
    pool = _LETTERS if answer[i].isalpha() else "0123456789"
    other = [c for c in pool if c != answer[i]]
    return answer[:i] + str(rng.choice(other)) + answer[i + 1:]


def sft_example(task: str, seed: int, index: int, think: bool = True, answer_noise: float = 0.0,
                **task_kwargs) -> dict[str, Any]:
    """`make_example` plus ``"response"``: the (prompt, response) record of the SFT warm start.

    With `answer_noise` = p, a fraction p of the demonstrations (chosen by seed and index)
    reason correctly but box a wrong answer (a tool task's skip the tool and box a wrong
    guess): a warm start with a flaw of the kind that SFT data
    has and a verifier-rewarded RL phase can find and correct."""
    if not 0.0 <= answer_noise < 1.0:
        raise ValueError(f"synthetic {task}: answer_noise={answer_noise} must be in [0, 1)")
    example = make_example(task, seed, index, **task_kwargs)
    boxed = None
    if answer_noise:
        rng = _rng(task + ":noise", seed, index)
        if rng.random() < answer_noise:
            boxed = wrong_answer(example["answer"], rng)
    if task in TOOL_TASKS:
        turns = tool_conversation(example, think=False, boxed=boxed, call=boxed is None)
        segments = turn_segments(turns)
        return {**example, "turns": turns, "response": "".join(t for t, _ in segments),
                "response_segments": segments}
    return {**example, "response": sft_response(example, think=think, boxed=boxed)}


def synthetic_corpus(num_examples: int = 2000, seed: int = 0,
                     tasks: Iterable[str] = ("kv_retrieval", "arithmetic"),
                     task_kwargs: dict[str, dict] | None = None) -> list[str]:
    """Texts to train the local tokenizer on: prompts and SFT responses of the tasks, plus the
    chat role names, so that keys, instructions and the answer format tokenize compactly.
    The tasks share the examples in turn; `task_kwargs[task]` are passed to the task."""
    tasks = list(tasks)
    if not tasks:
        raise ValueError("synthetic_corpus: no tasks given")
    task_kwargs = task_kwargs or {}
    texts = ["system\nuser\nassistant\n"] * 8
    for i in range(num_examples):
        task = tasks[i % len(tasks)]
        ex = sft_example(task, seed, i, **task_kwargs.get(task, {}))
        texts.append(ex["prompt"])
        if task in TOOL_TASKS:  # the markup and chat tokens are added tokens: not learnt
            texts.extend(_MARKUP.split(m["content"]) for m in ex["turns"])
        else:
            texts.append(ex["response"])
    return [t for x in texts for t in ([x] if isinstance(x, str) else x) if t]
