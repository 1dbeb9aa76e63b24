"""Verifiable rewards: a registry of `fn(completion, answer, **meta) -> float` selected by config,
weighted combinations, and a process pool that scores with per-call timeouts.
"""
from lrl.rewards.registry import Term, combine, get, names, parse_spec, register, terms_of

__all__ = ["Term", "combine", "get", "names", "parse_spec", "register", "terms_of"]
