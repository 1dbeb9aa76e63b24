"""Tool calls in the model family's own format, and `ToolEnv` (registered as "tools").

Formats (`parse_tool_calls(text, fmt)`):
  "qwen"   Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
           number per turn (Hermes style). An unclosed block is malformed.
  "llama"  Llama 3.1-3.3 JSON tool calls: the turn is a JSON object `{"name": ...,
           "parameters": {...}}` ("arguments" accepted too), optionally after
           `<|python_tag|>`, several separated by ";".
  "auto"   "qwen" if the text has `<tool_call>`, else "llama" if it starts with `{` or
           `<|python_tag|>`, else no call.
A `<think>...</think>` block is skipped first: a call the model only thinks about is not made.
Each call parses to `ToolCall(name, arguments, error)`; a malformed one has `error` set and
is answered with that error (it counts as a call and as a tool error), never raised.

`ToolEnv`: a turn with calls gets their results as the observation (one tool message each);
a turn without calls is the final answer, which ends the trajectory. Its reward is the row's
reward (`row["reward"]`, else the env's `reward`: any spec `lrl.rewards.combine` takes)
scored on the final turn against `row["answer"]`, with the row's "meta" as the reward's
keyword arguments; with neither (the default), the final turn's reward is 0 and the training
loop's reward spec scores the trajectory's answer (`lrl.trajectories`), so nothing is counted
twice. The row may also narrow the tools (`row["tools"]`) and carry a "table" for `lookup`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lrl.envs import tools as _tools
from lrl.envs.base import Environment, Step, register

FORMATS = ("auto", "qwen", "llama")
_THINK_RE = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_QWEN_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass
class ToolCall:
    name: str = ""
    arguments: Any = None
    error: Optional[str] = None   # set when the call is malformed


def _from_json(obj, args_keys: Sequence[str]) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall(error=f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error='a tool call needs a "name" string')
    key = next((k for k in args_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCall(name, error=f"{key} is a string that is not JSON: {e.msg}")
    if not isinstance(args, dict):
        return ToolCall(name, error=f'"{key}" must be a JSON object')
    return ToolCall(name, args)


def _parse_qwen(text: str) -> list[ToolCall]:
    calls = []
    for m in _QWEN_RE.finditer(text):
        if not m.group(0).endswith("</tool_call>"):
            calls.append(ToolCall(error="unclosed <tool_call> (no </tool_call>)"))
            continue
        try:
            obj = json.loads(m.group(1).strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call is not valid JSON: {e.msg} at "
                                        f"character {e.pos}"))
            continue
        calls.append(_from_json(obj, ("arguments", "parameters")))
    return calls


def _parse_llama(text: str) -> list[ToolCall]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call is not valid JSON: {e.msg} at "
                                        f"character {e.pos}"))
            break
        calls.append(_from_json(obj, ("parameters", "arguments")))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls


def parse_tool_calls(text: str, fmt: str = "auto") -> list[ToolCall]:
    """The tool calls of a model turn (see the module docstring); [] when there is none."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format must be one of {FORMATS}, got {fmt!r}")
    text = _THINK_RE.sub("", text)
    if fmt == "qwen" or (fmt == "auto" and "<tool_call>" in text):
        return _parse_qwen(text)
    if fmt == "llama" or fmt == "auto":
        return _parse_llama(text)
    return []


@register("tools")
class ToolEnv(Environment):
    """Tool use until a final answer (see the module docstring).

    Args:
      reward: the final answer's reward spec when the row has no "reward"; None (default):
        the env gives no final reward (the run's reward spec scores the answer).
      tools: the tools offered (default: every registered one); a row's "tools" narrows them.
      fmt: the tool-call format ("auto", "qwen", "llama").
      max_calls: calls run per turn; more are answered with an error.
    """
    role = "tool"

    def __init__(self, reward=None, tools: Optional[Sequence[str]] = None, fmt: str = "auto",
                 max_calls: int = 8):
        if fmt not in FORMATS:
            raise ValueError(f"ToolEnv: fmt must be one of {FORMATS}, got {fmt!r}")
        if max_calls < 1:
            raise ValueError(f"ToolEnv: max_calls must be >= 1, got {max_calls}")
        self.reward, self.fmt, self.max_calls = reward, fmt, max_calls
        self.tools = list(tools) if tools is not None else None
        for name in self.tools or ():
            _tools.get(name)  # unknown names fail here, at construction
        self.row: Mapping = {}

    def reset(self, row: Mapping) -> None:
        if row.get("reward", self.reward) is not None and "answer" not in row:
            raise ValueError(f"ToolEnv: the row needs an 'answer' for the final reward; it has "
                             f"{sorted(row)}")
        self.row = dict(row)
        if row.get("tools") is not None:
            self.tools = list(row["tools"])
        return None

    def step(self, turn_text: str, turn_tokens) -> Step:
        calls = parse_tool_calls(turn_text, self.fmt)
        if not calls:
            spec = self.row.get("reward", self.reward)
            if spec is None:
                return Step(None, 0.0, True)
            from lrl.rewards.registry import combine
            import lrl.rewards  # noqa: F401  (registers the built-in rewards)
            fn = combine(spec)
            meta = dict(self.row.get("meta") or {})
            return Step(None, float(fn(turn_text, str(self.row["answer"]), **meta)), True)
        results, errors = [], 0
        for i, c in enumerate(calls):
            if c.error is not None:
                text, ok = f"error: malformed tool call: {c.error}", False
            elif i >= self.max_calls:
                text, ok = f"error: more than {self.max_calls} tool calls in one turn", False
            else:
                text, ok = _tools.call(c.name, c.arguments, self.row, self.tools)
            results.append(text)
            errors += not ok
        return Step(results, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors})
