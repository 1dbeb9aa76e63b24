"""String-matching rewards: `exact`, `regex`, and `choice` (multiple-choice letter).

`choice` reads the final answer letter from the forms models actually write — `\\boxed{B}`,
"Answer: B", "the answer is (B).", "**Answer:** B", a last line "(B)" — and takes the one
written last. Several letters offered as the answer ("B or C", "\\boxed{A, C}") are ambiguous
and score 0, so hedging is never rewarded.
"""
from __future__ import annotations

import functools
import re
import unicodedata

from lrl.rewards.math import last_boxed, last_boxed_span

_WS_RE = re.compile(r"\s+")


def _norm(s: str, ignore_case: bool, normalize_whitespace: bool) -> str:
    s = unicodedata.normalize("NFC", s).strip()  # composed vs decomposed accents are one text
    if normalize_whitespace:
        s = _WS_RE.sub(" ", s)
    return s.casefold() if ignore_case else s


def _extract(completion: str, extract: str) -> str | None:
    if extract == "full":
        return completion
    if extract == "boxed":
        return last_boxed(completion)
    if extract == "last_line":
        lines = [l for l in completion.splitlines() if l.strip()]
        return lines[-1] if lines else None
    raise ValueError(
        f"exact reward: extract must be 'full', 'boxed' or 'last_line', got {extract!r}")


def exact_reward(completion: str, answer: str, *, extract: str = "full", ignore_case: bool = False,
                 normalize_whitespace: bool = True, **meta) -> float:
    """1.0 if the (extracted) completion equals `answer` after normalisation, else 0.0.

    Both sides are stripped and NFC-normalised; `normalize_whitespace` collapses runs of
    whitespace to one space; `ignore_case` compares casefolded. `extract` picks what is
    compared: the whole completion, its last \\boxed{} content, or its last non-empty line.
    """
    pred = _extract(completion, extract)
    if pred is None:
        return 0.0
    return float(_norm(pred, ignore_case, normalize_whitespace)
                 == _norm(str(answer), ignore_case, normalize_whitespace))


@functools.lru_cache(maxsize=256)
def _compile(pattern: str, ignore_case: bool) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL | (re.IGNORECASE if ignore_case else 0))
    except re.error as e:
        raise ValueError(f"regex reward: invalid pattern {pattern!r}: {e}") from None


def regex_reward(completion: str, answer: str, *, pattern: str | None = None, mode: str = "search",
                 ignore_case: bool = False, **meta) -> float:
    """1.0 if `pattern` matches the completion, else 0.0.

    `pattern` comes from the config or the example's meta; without one, the answer itself is
    the pattern. "{answer}" in a pattern is replaced by the escaped answer, so one config
    pattern such as r"Answer:\\s*{answer}\\b" serves every example. `mode` is "search" or
    "fullmatch" (against the completion stripped of surrounding whitespace).
    """
    if pattern is None:
        pattern = str(answer)
    else:
        pattern = pattern.replace("{answer}", re.escape(str(answer)))
    regex = _compile(pattern, bool(ignore_case))
    if mode == "search":
        return float(regex.search(completion) is not None)
    if mode == "fullmatch":
        return float(regex.fullmatch(completion.strip()) is not None)
    raise ValueError(f"regex reward: mode must be 'search' or 'fullmatch', got {mode!r}")


AMBIGUOUS = "?"
# "answer", "final answer", "correct option" ... optionally followed by "is" / ":".
_ANCHOR_RE = re.compile(
    r"\b(?:final\s+answer|answer|correct\s+(?:answer|option|choice))\b"
    r"(?:\s*\*\*)?(?:\s+(?:is|would\s+be|should\s+be))?\s*[:：]?", re.IGNORECASE)
# Markup wrapped around a letter: bold, math delimiters, \text{}, \textbf{}.
_MARKUP_RE = re.compile(r"\*\*|\$|\\text(?:bf)?\{|[{}]")
# A letter right at the start of what follows an anchor, then a list of further letters
# ("B or C", "A, B"). A bare letter must be followed by punctuation or the end of the line,
# so that "Answer: I think B" does not read as option I.
_LETTER = r"(?:option\s+|choice\s+)?(?:\(([A-Z])\)|([A-Z])(?=[\s]*(?:$|[.,;:)!/&]|\s(?:or|and)\s)))"
_LEAD_RE = re.compile(rf"\s*{_LETTER}((?:\s*(?:,|/|&|\bor\b|\band\b)\s*{_LETTER})*)")
_ANY_LETTER_RE = re.compile(r"\(([A-Z])\)|(?<![A-Za-z])([A-Z])(?![A-Za-z])")
_PAREN_LETTER_RE = re.compile(r"\(([A-Z])\)")
_GOLD_RE = re.compile(r"\(?([A-Za-z])\)?(?:[.):]|\s|$)")


def _pick(letters: list[str], choices: str) -> str | None:
    """The one distinct valid letter; AMBIGUOUS for several; None for none."""
    valid = {l for l in letters if l in choices}
    if len(valid) > 1:
        return AMBIGUOUS
    return valid.pop() if valid else None


def extract_choice(text: str, choices: str = "ABCDEFGHIJ") -> str | None:
    """The final answer letter of `text`, AMBIGUOUS if several are offered, None if none."""
    candidates: list[tuple[int, str]] = []  # (end position, letter)
    span = last_boxed_span(text)
    if span is not None:
        inner = _MARKUP_RE.sub(" ", text[span[0]:span[1]])
        letters = [a or b for a, b in _ANY_LETTER_RE.findall(inner)]
        candidates.append((span[1], _pick(letters, choices)))
    for m in _ANCHOR_RE.finditer(text):
        eol = text.find("\n", m.end())
        line = text[m.end():eol if eol >= 0 else len(text)]
        lead = _LEAD_RE.match(_MARKUP_RE.sub("", line))
        if lead is None:
            continue
        letters = [lead.group(1) or lead.group(2)]
        letters += [a or b for a, b in re.findall(_LETTER, lead.group(3))]
        picked = _pick(letters, choices)
        if picked is not None:
            candidates.append((m.end() + lead.end(), picked))
    if candidates:
        return max(candidates, key=lambda c: c[0])[1]
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines:
        return None
    last = _MARKUP_RE.sub("", lines[-1]).strip()
    whole = re.fullmatch(r"\(?([A-Z])\)?[.):]?", last)
    if whole:
        return _pick([whole.group(1)], choices)
    return _pick(_PAREN_LETTER_RE.findall(last), choices)


def _gold_letter(answer: str) -> str:
    m = _GOLD_RE.match(str(answer).strip())
    if m is None:
        raise ValueError(f"choice reward: answer {answer!r} is not an option letter such as 'B'")
    return m.group(1).upper()


def choice_reward(completion: str, answer: str, *, choices: str = "ABCDEFGHIJ", **meta) -> float:
    """1.0 if the completion's final answer letter is the answer's letter, else 0.0."""
    gold = _gold_letter(answer)
    if gold not in choices:
        raise ValueError(f"choice reward: answer {answer!r} is not among choices {choices!r}")
    return float(extract_choice(completion, choices) == gold)
