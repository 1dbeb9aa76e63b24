"""XLA compilations counted by function name, from jax's own monitoring events, so a run can
say how many programs each step compiled (a step's lengths must change how many calls it
makes, never a shape) and a test can hold it to that.

    before = compiles.snapshot()
    ...                                   # a step
    new = compiles.since(before)          # {"jit(decode_steps)": 1, ...}
"""
from __future__ import annotations

import collections
import logging
import threading
import time

_COUNTS: collections.Counter = collections.Counter()
_SECONDS: collections.Counter = collections.Counter()   # compile seconds, by function name
_LOCK = threading.Lock()
_EVENT = "/jax/core/compile/backend_compile_duration"
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == _EVENT:
        with _LOCK:
            name = str(kwargs.get("fun_name", "?"))
            _COUNTS[name] += 1
            _SECONDS[name] += duration


def install() -> None:
    """Starts counting (once per process; jax keeps its listeners for the process's life)."""
    global _registered
    if not _registered:
        from jax import monitoring
        monitoring.register_event_duration_secs_listener(_listener)
        _registered = True


def snapshot() -> collections.Counter:
    install()
    with _LOCK:
        return collections.Counter(_COUNTS)


def since(before: collections.Counter) -> dict:
    """Compilations since `before`, by function name."""
    now = snapshot()
    return {k: v - before.get(k, 0) for k, v in now.items() if v > before.get(k, 0)}


def total() -> int:
    return sum(snapshot().values())


def seconds() -> collections.Counter:
    """Seconds spent compiling so far, by function name (XLA's backend compile, or loading the
    program from the persistent cache where it was there: jax times both as one event)."""
    install()
    with _LOCK:
        return collections.Counter(_SECONDS)


def seconds_since(before: collections.Counter) -> dict:
    now = seconds()
    return {k: v - before.get(k, 0.0) for k, v in now.items() if v > before.get(k, 0.0)}


def _costliest(spent: dict, n: int) -> list[tuple[str, str, float]]:
    """(jax's name, the function's, seconds) of the `n` costliest programs in `spent`."""
    worst = sorted(spent.items(), key=lambda kv: -kv[1])[:n]
    return [(k, k.removeprefix("jit(").removesuffix(")"), v) for k, v in worst]


def top(spent: dict, n: int = 6, key: str = "compile_s") -> dict:
    """{"<key>/<name>": seconds} of the `n` costliest programs in `spent`: metrics a run's
    first step records (metrics.jsonl), the console left quiet."""
    return {f"{key}/{name}": v for _, name, v in _costliest(spent, n)}


def describe(spent: dict, counts: dict, n: int = 6) -> str:
    """`name x count s, ...`, the costliest first: where a start's compile time went."""
    return ", ".join(f"{name} x{counts.get(k, 0)} {v:.1f} s"
                     for k, name, v in _costliest(spent, n))


class Background:
    """`fn(item)` for each of `items` on a daemon thread, in order: programs compiled while
    the caller goes on (the update's other shapes while the first rollout runs; jax's caches
    then serve the step that calls them). `wait()` before anything could compile the same
    program: two threads that miss jax's cache at once both compile. A failure is logged and
    dropped: the caller's own call compiles the program then, and raises what it raises."""

    def __init__(self, fn, items, name: str = "lrl-compile"):
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, list(items)), name=name,
                                        daemon=True)
        self._thread.start()

    def _run(self, fn, items) -> None:
        try:
            for item in items:
                fn(item)
        except Exception as e:   # noqa: BLE001 (the foreground compile reports it)
            logging.getLogger(__name__).info("compiling ahead stopped at %s: %s", item, e)
        finally:
            self._done.set()

    def wait(self) -> float:
        """Blocks until every item is done -> the seconds this call waited."""
        t0 = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - t0
