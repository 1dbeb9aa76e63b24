"""Reward registry and weighted combinations selected by config.

A reward is `fn(completion: str, answer: str, **meta) -> float`. Functions are registered by
name (`@register("math")`) and referred to by that name everywhere, so that a reward spec
(a name, or a list of (name, weight[, kwargs]) terms) pickles into worker processes: the
worker imports the module that registered each name and looks the name up again.

Spec forms accepted by `parse_spec` / `combine` / `RewardPool`:
    "math"                                   one term, weight 1
    "math:1.0,format:0.1"                    command-line friendly string
    {"math": 1.0, "format": 0.1}             mapping name -> weight
    [("math", 1.0), ("format", 0.1, {"require_boxed": True})]
Per-term kwargs are defaults; per-example meta from the data overrides them, so every reward
must accept (and ignore) meta keys it does not use.
"""
from __future__ import annotations

import functools
import importlib
import math as _pymath
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

RewardFn = Callable[..., float]

_REGISTRY: dict[str, RewardFn] = {}


class Term(NamedTuple):
    """One weighted reward term; `module` is where `name` gets registered (for workers)."""
    name: str
    weight: float
    kwargs: tuple[tuple[str, object], ...]
    module: str


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`; registering the same function again is a no-op."""
    if not isinstance(name, str) or not name or ":" in name or "," in name:
        raise ValueError(f"reward name must be a non-empty string without ':' or ',', got {name!r}")

    def deco(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        # A re-import of the same module (spawned workers, pytest) registers an equal function.
        if old is not None and (old.__module__, old.__qualname__) != (
                fn.__module__, fn.__qualname__):
            raise ValueError(
                f"reward {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        _REGISTRY[name] = fn
        return fn

    return deco


def names() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def get(name: str, module: str | None = None) -> RewardFn:
    """The reward registered as `name`; `module` is imported first when the name is unknown."""
    if name not in _REGISTRY and module:
        importlib.import_module(module)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def parse_spec(spec) -> tuple[Term, ...]:
    """Normalises any accepted spec form (see module docstring) to a tuple of Terms."""
    if isinstance(spec, str):
        items = []
        for part in spec.split(","):
            name, _, weight = part.strip().partition(":")
            items.append((name.strip(), float(weight) if weight.strip() else 1.0))
    elif isinstance(spec, Mapping) or hasattr(spec, "items"):  # ml_collections.ConfigDict too
        items = list(spec.items())
    elif isinstance(spec, Sequence) and all(isinstance(s, (str, Sequence)) for s in spec):
        items = [(s, 1.0) if isinstance(s, str) else tuple(s) for s in spec]
    else:
        raise ValueError(f"reward spec must be a name, a mapping or a list of terms, got {spec!r}")
    if not items:
        raise ValueError("reward spec is empty")
    terms = []
    for item in items:
        if len(item) not in (2, 3):
            raise ValueError(
                f"reward term must be (name, weight) or (name, weight, kwargs), got {item!r}")
        name, weight = item[0], float(item[1])
        kwargs = dict(item[2].items()) if len(item) == 3 and item[2] else {}
        if not _pymath.isfinite(weight):
            raise ValueError(f"reward {name!r} has a non-finite weight {weight}")
        fn = get(name)
        terms.append(Term(name, weight, tuple(sorted(kwargs.items())), fn.__module__))
    return tuple(terms)


def terms_of(fn_or_spec) -> tuple[Term, ...]:
    """Terms of a spec, of a `combine` result, or of a registered function."""
    if isinstance(fn_or_spec, functools.partial) and fn_or_spec.func is weighted_sum:
        return fn_or_spec.keywords["terms"]
    if callable(fn_or_spec):
        for name, fn in _REGISTRY.items():
            if fn is fn_or_spec:
                return (Term(name, 1.0, (), fn.__module__),)
        raise ValueError(f"{fn_or_spec!r} is not a registered reward; decorate it with "
                         "@lrl.rewards.register(name) so that worker processes can find it")
    return parse_spec(fn_or_spec)


def score_terms(terms: Sequence[Term], completion: str, answer: str, meta: Mapping) -> list[float]:
    """Unweighted score of each term; raises if a term raises or returns a non-finite value."""
    out = []
    for term in terms:
        fn = get(term.name, term.module)
        value = float(fn(completion, answer, **{**dict(term.kwargs), **meta}))
        if not _pymath.isfinite(value):
            raise ValueError(f"reward {term.name!r} returned a non-finite value {value}")
        out.append(value)
    return out


def weighted_sum(completion: str, answer: str, *, terms: Sequence[Term], **meta) -> float:
    """Σ weight · term(completion, answer, **meta): the function that `combine` binds."""
    values = score_terms(terms, completion, answer, meta)
    return float(sum(t.weight * v for t, v in zip(terms, values)))


def combine(spec) -> RewardFn:
    """A picklable reward computing the weighted sum of the spec's terms."""
    return functools.partial(weighted_sum, terms=parse_spec(spec))
