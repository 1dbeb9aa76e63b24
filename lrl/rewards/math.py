"""Math answers: the last \\boxed{...} of a completion, judged equal to the answer by math-verify.

`last_boxed` finds the last top-level \\boxed{...} / \\fbox{...} (nested and escaped braces,
and the brace-less `\\boxed 5` form); `math_reward` parses it and the reference answer with
`math_verify.parse` and compares them with `math_verify.verify`, so 1/2, 0.5 and \\frac{1}{2},
or x=3 and 3, or {1,2} and {2,1} score the same. Malformed output scores 0 without raising.

math-verify bounds its own work with SIGALRM, which exists only in a process's main thread;
`math_reward` uses it there (a RewardPool worker) and switches it off elsewhere (the pool's
in-process thread mode), where the caller's timeout applies instead. A math-verify timeout is
raised as `TimeoutError`, which RewardPool counts as a timeout, not as a wrong answer.
"""
from __future__ import annotations

import math as _pymath
import re
import threading

import math_verify
import math_verify.grader
import math_verify.parser
from math_verify.errors import TimeoutException


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_SCI_RE = re.compile(r"^([+-]?\d+(?:\.\d+)?)[eE]([+-]?\d+)$")
# LaTeX spacing and sizing that never changes a value; removed before the string fallback.
_NOISE_RE = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle|\s+")
_EXTRACTION = (math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig())

# We pass timeout=None on purpose outside the main thread (the caller bounds the time), so
# math-verify's one-off "timeout is disabled" warning would only mislead.
math_verify.parser.TIMEOUT_WARNING_SHOWN = True
math_verify.grader.TIMEOUT_WARNING_SHOWN = True


def _braced(text: str, start: int) -> int | None:
    """Index just past the group opening at text[start] == '{', or None if it never closes."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # \{ and \} are literal braces (set notation) and do not nest
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed_span(text: str) -> tuple[int, int] | None:
    """(start, end) of the content of the last top-level \\boxed{...} / \\fbox{...} / `\\boxed x`;
    None if there is none or the last one never closes."""
    found, pos = None, 0
    while (m := _BOX_RE.search(text, pos)) is not None:
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            end = _braced(text, i)
            if end is None:  # unclosed: a truncated answer is no answer
                return None
            found, pos = (i + 1, end - 1), end
        elif i > m.end():  # `\boxed 5`: the token up to whitespace or a math delimiter
            token = re.match(r"[^\s$]*", text[i:]).group(0).rstrip(".,;")
            found, pos = ((i, i + len(token)) if token else None), i + len(token) + 1
        else:
            pos = m.end()
    return found


def last_boxed(text: str) -> str | None:
    """Content of the last top-level \\boxed{...} or \\fbox{...}; None if absent or unclosed."""
    span = last_boxed_span(text)
    return None if span is None else text[span[0]:span[1]]


def _to_latex(answer: str) -> str:
    """The answer as math-verify reads it: boxed content if boxed, 1e308 as 1 \\times 10^{308}."""
    s = answer.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed.strip()
    s = s.strip("$").strip()
    m = _SCI_RE.match(s)
    if m:  # inside $...$ math-verify would read "e" as Euler's number
        s = f"{m.group(1)} \\times 10^{{{m.group(2)}}}"
    return s


def _plain(s: str) -> str:
    return _NOISE_RE.sub("", s).rstrip(".")


def math_equal(pred: str, gold: str, timeout_s: int | None = 5) -> bool:
    """Whether two answer strings are mathematically equal according to math-verify.

    `timeout_s` (rounded up to whole seconds: SIGALRM) is applied only in the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None
    elif timeout_s is not None:
        # signal.alarm takes whole seconds; a float would make every comparison fail quietly.
        timeout_s = max(1, _pymath.ceil(timeout_s))
    pred_s, gold_s = _to_latex(pred), _to_latex(gold)
    if not pred_s or not gold_s:
        return False
    # Identical strings are equal even where sympy cannot parse them (e.g. a 5000-digit
    # integer is over Python's int-from-string limit).
    if _plain(pred_s) == _plain(gold_s):
        return True
    try:
        gold_p = math_verify.parse(f"${gold_s}$", _EXTRACTION, parsing_timeout=timeout_s,
                                   raise_on_error=True)
        pred_p = math_verify.parse(f"${pred_s}$", _EXTRACTION, parsing_timeout=timeout_s,
                                   raise_on_error=True)
        return bool(gold_p and pred_p and math_verify.verify(
            gold_p, pred_p, timeout_seconds=timeout_s, raise_on_error=True))
    except TimeoutException as e:
        raise TimeoutError(f"math-verify gave up after {timeout_s}s") from e
    except Exception:  # sympy cannot read or compare it: not a recognisable equal answer
        return False


def math_reward(completion: str, answer: str, *, timeout_s: int | None = 5, **meta) -> float:
    """1.0 if the completion's last \\boxed{} equals `answer` (math-verify), else 0.0."""
    pred = last_boxed(completion)
    if pred is None:
        return 0.0
    return float(math_equal(pred, str(answer), timeout_s=timeout_s))  # json may hold numbers
