"""Tools: functions a model calls by name, with JSON-schema argument specs and validation.

    @tool("calc", "Evaluates an arithmetic expression.",
          {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}})
    def calc(expression: str) -> str: ...

`parameters` maps each argument to a JSON-schema property (type: string, integer, number,
boolean, array, object; optional enum and description); all are required unless listed in
`optional`, and unknown arguments are refused. A tool that needs the dataset row (e.g. a
table to look keys up in) names a `row` parameter, which is passed and is not an argument.
`call(name, arguments, row)` validates and runs a tool and returns (text, ok): a bad name or
argument, a `ToolError` or any exception the tool raises becomes text that says so (ok=False)
for the model to read, never an exception. `schemas(names)` gives the OpenAI-style function
specs that chat templates' `tools=` argument takes, to list the tools in the prompt.

Built-ins: `calc` (arithmetic over numbers with + - * / // % ** and parentheses, evaluated on
the parsed syntax tree: no names, attributes or calls, and bounded sizes) and `lookup` (a key
in the row's "table").
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence

_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
          "array": (list, tuple), "object": (dict,)}
MAX_RESULT_CHARS = 4000


class ToolError(Exception):
    """Raised by a tool for a bad request; its message is what the model reads."""


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict          # argument -> JSON-schema property
    optional: tuple[str, ...]
    fn: Callable
    wants_row: bool

    def schema(self) -> dict:
        """The OpenAI-style function spec (what `apply_chat_template(tools=...)` takes)."""
        required = [k for k in self.parameters if k not in self.optional]
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": self.parameters,
                           "required": required}}}


_TOOLS: dict[str, Tool] = {}


def tool(name: str, description: str, parameters: Mapping[str, Mapping] | None = None, *,
         optional: Sequence[str] = ()):
    """Decorator registering `fn` as the tool `name` (see the module docstring)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"tool name must be an identifier, got {name!r}")
    parameters = {k: dict(v) for k, v in (parameters or {}).items()}
    for arg, prop in parameters.items():
        if prop.get("type") not in _TYPES:
            raise ValueError(f"tool {name!r}: argument {arg!r} has type {prop.get('type')!r}; "
                             f"expected one of {sorted(_TYPES)}")
    unknown = set(optional) - set(parameters)
    if unknown:
        raise ValueError(f"tool {name!r}: optional names unknown arguments {sorted(unknown)}")

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn).parameters
        missing = [a for a in parameters if a not in sig]
        if missing:
            raise ValueError(f"tool {name!r}: {fn.__qualname__} has no parameter for {missing}")
        old = _TOOLS.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (
                fn.__module__, fn.__qualname__):
            raise ValueError(f"tool {name!r} is already registered by "
                             f"{old.fn.__module__}.{old.fn.__qualname__}")
        _TOOLS[name] = Tool(name, description, parameters, tuple(optional), fn, "row" in sig)
        return fn

    return deco


def names() -> list[str]:
    return sorted(_TOOLS)


def get(name: str) -> Tool:
    if name not in _TOOLS:
        raise KeyError(f"unknown tool {name!r}; registered: {', '.join(sorted(_TOOLS))}")
    return _TOOLS[name]


def schemas(tool_names: Sequence[str] | None = None) -> list[dict]:
    """OpenAI-style specs of these tools (default: all), for the chat template's `tools=`."""
    return [get(n).schema() for n in (names() if tool_names is None else tool_names)]


def validate(t: Tool, arguments) -> str | None:
    """None if `arguments` fit the tool's parameters, else what is wrong."""
    if not isinstance(arguments, Mapping):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    unknown = sorted(set(arguments) - set(t.parameters))
    if unknown:
        return f"unknown argument(s) {unknown}; {t.name} takes {sorted(t.parameters)}"
    missing = [k for k in t.parameters if k not in t.optional and k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for k, v in arguments.items():
        prop = t.parameters[k]
        kind = prop["type"]
        # JSON has no int/bool distinction worth trusting: true is not the integer 1 here.
        if not isinstance(v, _TYPES[kind]) or (isinstance(v, bool) and kind != "boolean"):
            return f"argument {k!r} must be of type {kind}, got {json.dumps(v)}"
        if "enum" in prop and v not in prop["enum"]:
            return f"argument {k!r} must be one of {prop['enum']}, got {json.dumps(v)}"
    return None


def call(name: str, arguments, row: Mapping | None = None,
         allowed: Sequence[str] | None = None) -> tuple[str, bool]:
    """Validates and runs one call; -> (text for the model, ok). Never raises for the call's
    own faults: the model reads what went wrong."""
    if name not in _TOOLS or (allowed is not None and name not in allowed):
        offered = sorted(_TOOLS) if allowed is None else list(allowed)
        return f"error: unknown tool {name!r}; available: {', '.join(offered)}", False
    t = _TOOLS[name]
    problem = validate(t, arguments)
    if problem is not None:
        return f"error: {name}: {problem}", False
    try:
        result = t.fn(**arguments, **({"row": row or {}} if t.wants_row else {}))
    except ToolError as e:
        return f"error: {name}: {e}", False
    except Exception as e:  # noqa: BLE001 - a tool's crash is the model's observation
        return f"error: {name} failed: {type(e).__name__}: {e}", False
    text = result if isinstance(result, str) else json.dumps(result)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"... [{len(text) - MAX_RESULT_CHARS} more characters]"
    return text, True


# ----- built-in tools ---------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 1000
MAX_BITS = 4096     # integers beyond ~1200 digits are refused (2**10**10 would hang the worker)


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(b) > 10_000 or (isinstance(a, int) and isinstance(b, int)
                                   and b > 0 and a.bit_length() * b > MAX_BITS):
                raise ToolError("power too large")
        out = _BINARY[type(node.op)](a, b)
        if isinstance(out, complex):
            raise ToolError("complex result")
        if isinstance(out, int) and out.bit_length() > MAX_BITS:
            raise ToolError("number too large")
        return out
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"constant {node.value!r}"
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


@tool("calc", "Evaluates an arithmetic expression exactly (integers of any size, decimals).",
      {"expression": {"type": "string",
                      "description": "numbers with + - * / // % ** and parentheses"}})
def calc(expression: str) -> str:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("number too large") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("result is not finite")
        return format(value, ".12g")
    return str(value)


@tool("lookup", "Looks a key up in the table of this task.",
      {"key": {"type": "string", "description": "the key to look up"}})
def lookup(key: str, row: Mapping) -> str:
    table = row.get("table")
    if not isinstance(table, Mapping):
        raise ToolError("this task has no table")
    if key not in table:
        return f"no entry for {key!r}"
    value = table[key]
    return value if isinstance(value, str) else json.dumps(value)
