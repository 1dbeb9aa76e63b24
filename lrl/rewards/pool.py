"""Scoring completions in worker processes with a per-call timeout.

`RewardPool(spec, num_workers, timeout_s).score(items)` scores (completion, answer, meta)
items and returns float32 rewards plus counts of timeouts and errors; a failed item scores 0
and is counted. Only a reward that keeps failing stops the run: `fail_patience` scoring calls
in a row (the loop makes one per rollout batch) in which at least `fail_frac` of the items
failed raise `RewardFailure`, naming the reward and the first error of those calls.

Each worker (`lrl.rewards.workers`) is a separate process that handles one call at a time,
so the parent knows when every call started: a call over `timeout_s` gets its worker killed
and replaced (a hung sympy simplification cannot be interrupted any other way), and the item
scores 0. Workers come from a forkserver (or spawn) context, never from fork: the parent has
JAX loaded, and fork after JAX's threads have started is unsafe.

Rewards travel as registry names (`lrl.rewards.registry.Term`), and each worker imports the
module that registered them, so a reward registered in a test file or a script works too.
`num_workers=0` scores in-process for debugging; a timeout there runs the call in a thread
that is abandoned (still running) when it overruns, and is counted all the same.

The same workers run other host code without blocking (multi-turn environments,
`lrl.envs.driver`): `ticket = pool.submit(fn, *args, timeout_s=...)` queues a call of a
module-level function, `pool.poll(timeout_s)` returns the finished ones as (ticket, status,
payload), `pool.cancel(ticket)` forgets one (killing its worker if it runs). Calls and
scoring items share one queue, so `score` may run while calls are in flight.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from lrl.rewards.registry import score_terms, terms_of
from lrl.rewards.workers import WorkerQueue

log = logging.getLogger(__name__)


class RewardFailure(RuntimeError):
    """A reward failed (errors, timeouts) on too many items of too many scoring calls."""


def _normalise_items(items) -> list[tuple[str, str, dict]]:
    out = []
    for i, item in enumerate(items):
        if len(item) not in (2, 3):
            raise ValueError(
                f"reward item {i} must be (completion, answer[, meta]), got {len(item)} fields")
        completion, answer = item[0], item[1]
        meta = item[2] if len(item) == 3 and item[2] is not None else {}
        if not isinstance(completion, str):
            raise ValueError(
                f"reward item {i}: completion must be a str, got {type(completion).__name__}")
        if not isinstance(meta, Mapping):
            raise ValueError(f"reward item {i}: meta must be a mapping, got {type(meta).__name__}")
        out.append((completion, answer, dict(meta)))
    return out


class RewardPool(WorkerQueue):
    """Scores (completion, answer, meta) items with per-call timeouts; see the module docstring.

    Args:
      fn_or_spec: a registered reward, a `combine(...)` result, or any spec `parse_spec` takes.
      num_workers: worker processes; 0 scores in the calling process.
      timeout_s: per-call limit in seconds (None: no limit).
      mp_context: "forkserver" (default; workers fork from a clean server that has the reward
        modules preloaded, so a replacement starts fast) or "spawn".
      start_timeout_s: how long a new worker may take to import its rewards.
      fail_frac: a scoring call in which at least this fraction of the items failed (error or
        timeout) counts as failed; in (0, 1].
      fail_patience: that many failed calls in a row raise `RewardFailure`; 0 never does.
    """

    def __init__(self, fn_or_spec, num_workers: int = 4, timeout_s: float | None = 10.0, *,
                 mp_context: str = "forkserver", start_timeout_s: float = 120.0,
                 fail_frac: float = 1.0, fail_patience: int = 3):
        if not 0.0 < fail_frac <= 1.0 or fail_patience < 0:
            raise ValueError(f"need 0 < fail_frac <= 1 and fail_patience >= 0, got "
                             f"fail_frac={fail_frac}, fail_patience={fail_patience}")
        super().__init__(terms_of(fn_or_spec), num_workers, timeout_s, mp_context,
                         start_timeout_s)
        self._first_failure: str | None = None
        self.fail_frac, self.fail_patience = fail_frac, fail_patience
        self._failed_calls = 0  # in a row
        self._streak_first: str | None = None  # the first error of those calls

    # ----- scoring ----------------------------------------------------------------------

    def score(self, items: Sequence) -> tuple[np.ndarray, dict[str, float]]:
        """Rewards float32 [len(items)] and stats: n_items, n_timeout, n_error, wall_s,
        n_restarts (workers replaced during this call), term_mean/<name> (the unweighted mean
        of each term over the items that scored without timeout or error)."""
        items = _normalise_items(items)
        t0 = time.monotonic()
        values = np.full((len(items), len(self.terms)), np.nan, np.float64)
        status = ["pending"] * len(items)
        self._first_failure = None
        restarts_before = self.n_restarts
        if self.num_workers == 0:
            for i, item in enumerate(items):
                status[i], payload = self._call_in_process(item)
                if status[i] == "ok":
                    values[i] = payload
                else:
                    self._report(i, status[i], payload)
        else:
            self._score_in_workers(items, values, status)
        weights = np.array([t.weight for t in self.terms], np.float64)
        ok = np.array([s == "ok" for s in status], bool)
        rewards = np.where(ok, np.nan_to_num(values) @ weights, 0.0).astype(np.float32)
        stats = {
            "n_items": float(len(items)),
            "n_timeout": float(sum(s == "timeout" for s in status)),
            "n_error": float(sum(s == "error" for s in status)),
            "n_restarts": float(self.n_restarts - restarts_before),
            "wall_s": time.monotonic() - t0,
        }
        term_names = [t.name for t in self.terms]
        for j, name in enumerate(term_names):
            key = f"term_mean/{name}" if term_names.count(name) == 1 else f"term_mean/{name}_{j}"
            stats[key] = float(values[ok, j].mean()) if ok.any() else 0.0
        if self._first_failure is not None:
            log.warning("rewards: %d timeouts and %d errors in %d items, scored 0; first: %s",
                        stats["n_timeout"], stats["n_error"], len(items), self._first_failure)
        self._count_failures(len(items), int(len(items) - ok.sum()))
        return rewards, stats

    def _count_failures(self, n: int, failed: int) -> None:
        # A reward that fails everywhere would otherwise only warn, scoring 0 for ever: the
        # run would go on learning from nothing.
        if not self.fail_patience or not n:
            return
        if failed < self.fail_frac * n:
            self._failed_calls, self._streak_first = 0, None
            return
        self._failed_calls += 1
        self._streak_first = self._streak_first or self._first_failure
        if self._failed_calls >= self.fail_patience:
            names = ", ".join(repr(t.name) for t in self.terms)
            share = "every item" if self.fail_frac == 1.0 else \
                f"at least {self.fail_frac:.0%} of the items"
            raise RewardFailure(
                f"reward {names} failed on {share} of {self._failed_calls} scoring calls in a "
                f"row (reward.fail_frac={self.fail_frac}, reward.fail_patience="
                f"{self.fail_patience}); first error: {self._streak_first}")

    def _report(self, idx: int, status: str, message: str) -> None:
        # Only the first failure of a call is logged: a broken reward fails on every item.
        if self._first_failure is None:
            self._first_failure = f"item {idx}: {status}: {message}"

    def _call_in_process(self, item) -> tuple[str, object]:
        completion, answer, meta = item

        def call():
            try:
                return "ok", score_terms(self.terms, completion, answer, meta)
            except TimeoutError as e:
                return "timeout", f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
                return "error", f"{type(e).__name__}: {e}"

        if self.timeout_s is None:
            return call()
        box = []
        thread = threading.Thread(target=lambda: box.append(call()), daemon=True,
                                  name="lrl-reward-call")
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():  # Python cannot kill a thread: it is left behind, daemonic
            return "timeout", f"call exceeded {self.timeout_s}s (in-process thread left running)"
        return box[0]

    def _score_in_workers(self, items, values: np.ndarray, status: list[str]) -> None:
        tickets = [self._enqueue(("score", *item), self.timeout_s) for item in items]
        try:
            while any(t not in self._done for t in tickets):
                self._pump(None)
        finally:
            results = [self._done.pop(t, ("error", "pool closed")) for t in tickets]
        for idx, (outcome, payload) in enumerate(results):
            status[idx] = outcome
            if outcome == "ok":
                values[idx] = payload
            else:
                self._report(idx, outcome, payload)
