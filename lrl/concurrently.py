"""Compiling several XLA programs at once. A start compiles a dozen programs whose shapes are
known up front (the update's micro-batch candidates, its row-length buckets); XLA compiles
with Python's GIL released, so threads compile them side by side on the host's cores (the
H200's host: 16) where one after another they took most of a first step (91 s of 130 s at
Qwen2.5-1.5B, BENCHMARKS.md "Start-up").

Nothing here runs a program: running two at once would hold both one's buffers.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable


def workers(n: int) -> int:
    """Threads for n compiles: the host's cores, up to 8 (each compile is itself threaded in
    parts, and the GPU autotuner's buffers of concurrent compiles add up)."""
    return max(1, min(n, 8, os.cpu_count() or 1))


def run(fns: list[Callable]) -> list:
    """Calls each of `fns` in threads; -> their results in order (the first error raised)."""
    if len(fns) <= 1:
        return [f() for f in fns]
    with ThreadPoolExecutor(workers(len(fns))) as ex:
        futures = [ex.submit(f) for f in fns]
        return [f.result() for f in futures]


class Memo:
    """Values computed once by key, whoever asks and from whichever thread (a second caller
    of a key being computed waits for the first)."""

    def __init__(self):
        self._values: dict = {}
        self._locks: dict = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, fn: Callable):
        with self._lock:
            if key in self._values:
                return self._values[key]
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._values:
                    return self._values[key]
            value = fn()
            with self._lock:
                self._values[key] = value
            return value

    def known(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._values

    def fill(self, jobs: dict) -> None:
        """Computes the keys of `jobs` (key -> fn) not known yet, at once."""
        todo = [(k, f) for k, f in jobs.items() if not self.known(k)]
        run([lambda k=k, f=f: self.get(k, f) for k, f in todo])
