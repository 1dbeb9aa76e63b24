"""Scoring completions in worker processes with a per-call timeout.

`RewardPool(spec, num_workers, timeout_s).score(items)` scores (completion, answer, meta)
items and returns float32 rewards plus counts of timeouts and errors; a failed item scores 0
and is counted. Only a reward that keeps failing stops the run: `fail_patience` scoring calls
in a row (the loop makes one per rollout batch) in which at least `fail_frac` of the items
failed raise `RewardFailure`, naming the reward and the first error of those calls.

Each worker is a separate process that handles one call at a time, so the parent knows when
every call started: a call over `timeout_s` gets its worker killed and replaced (a hung sympy
simplification cannot be interrupted any other way), and the item scores 0. Workers come from
a forkserver (or spawn) context, never from fork: the parent has JAX loaded, and fork after
JAX's threads have started is unsafe.

Rewards travel as registry names (`lrl.rewards.registry.Term`), and each worker imports the
module that registered them, so a reward registered in a test file or a script works too.
`num_workers=0` scores in-process for debugging; a timeout there runs the call in a thread
that is abandoned (still running) when it overruns, and is counted all the same.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from lrl.rewards.registry import Term, get, score_terms, terms_of

log = logging.getLogger(__name__)

_BUILTIN_MODULES = ("lrl.rewards.registry", "lrl.rewards.math", "lrl.rewards.match",
                    "lrl.rewards.format", "lrl.rewards.synthetic")


def _worker_main(conn, terms: tuple[Term, ...]) -> None:
    """Worker loop: resolve the rewards once, then answer one call per message."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for term in terms:
            get(term.name, term.module)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        idx, completion, answer, meta = msg
        try:
            conn.send((idx, "ok", score_terms(terms, completion, answer, meta)))
        except TimeoutError as e:  # a reward's own time limit (e.g. math-verify's)
            conn.send((idx, "timeout", f"{type(e).__name__}: {e}"))
        except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
            conn.send((idx, "error", f"{type(e).__name__}: {e}"))


class RewardFailure(RuntimeError):
    """A reward failed (errors, timeouts) on too many items of too many scoring calls."""


def _exit_status(process) -> str:
    # The pipe closes before the process is reaped: its exit code is None until joined.
    process.join(timeout=5)
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclasses.dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: mp.connection.Connection
    state: str  # "starting" | "idle" | "busy"
    since: float  # when it started starting, or started its current call
    idx: int = -1


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


class RewardPool:
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
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not 0.0 < fail_frac <= 1.0 or fail_patience < 0:
            raise ValueError(f"need 0 < fail_frac <= 1 and fail_patience >= 0, got "
                             f"fail_frac={fail_frac}, fail_patience={fail_patience}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if mp_context not in ("forkserver", "spawn"):
            raise ValueError(f"mp_context must be 'forkserver' or 'spawn' (fork is unsafe once JAX "
                             f"is loaded), got {mp_context!r}")
        self.terms = terms_of(fn_or_spec)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context(mp_context)
        if mp_context == "forkserver":
            # Import the rewards (sympy, math-verify) once in the server, not in every worker.
            # No effect if this process's forkserver already runs; workers then import lazily.
            modules = sorted(set(_BUILTIN_MODULES) | {t.module for t in self.terms} - {"__main__"})
            self._ctx.set_forkserver_preload(modules)
        self._workers: list[_Worker] = []
        self.n_restarts = 0
        self._first_failure: str | None = None
        self.fail_frac, self.fail_patience = fail_frac, fail_patience
        self._failed_calls = 0  # in a row
        self._streak_first: str | None = None  # the first error of those calls

    # ----- worker processes -------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child_conn, self.terms),
                                    name="lrl-reward-worker", daemon=True)
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, "starting", time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        """Kills `worker` (it may be stuck in C code, so SIGKILL) and starts a fresh one."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.n_restarts += 1

    def close(self) -> None:
        """Stops all workers; the pool starts new ones if `score` is called again."""
        for w in self._workers:
            try:
                if w.state != "busy":
                    w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=10)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

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
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        pending = collections.deque(range(len(items)))
        remaining = len(items)

        def finish(idx: int, outcome: str, payload) -> None:
            nonlocal remaining
            remaining -= 1
            status[idx] = outcome
            if outcome == "ok":
                values[idx] = payload
            else:
                self._report(idx, outcome, payload)

        while remaining:
            for w in self._workers:
                if w.state == "idle" and pending:
                    self._send(w, pending, items, finish)
            waiting = [w for w in self._workers if w.state in ("starting", "busy")]
            ready = mp.connection.wait([w.conn for w in waiting], timeout=self._wait_s(waiting))
            for w in [w for w in waiting if w.conn in ready]:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if w.state == "starting":
                    self._on_started(w, msg)
                elif msg is None:  # the worker died mid-call (segfault, os._exit, OOM kill)
                    finish(w.idx, "error", f"worker died, {_exit_status(w.process)}")
                    self._replace(w)
                else:
                    finish(w.idx, msg[1], msg[2])
                    w.state = "idle"
            self._expire(finish)

    def _send(self, w: _Worker, pending: collections.deque, items, finish) -> None:
        idx = pending.popleft()
        try:
            w.conn.send((idx, *items[idx]))
        except (OSError, EOFError):  # it died while idle: not the item's fault, so retry it
            pending.appendleft(idx)
            self._replace(w)
            return
        except Exception as e:  # noqa: BLE001 - meta that does not pickle
            finish(idx, "error", f"cannot send it to a worker: {type(e).__name__}: {e}")
            return
        w.state, w.since, w.idx = "busy", time.monotonic(), idx

    def _wait_s(self, waiting: list[_Worker]) -> float | None:
        """Seconds until the nearest call or start-up deadline; None if there is none."""
        deadlines = [w.since + self.start_timeout_s for w in waiting if w.state == "starting"]
        if self.timeout_s is not None:
            deadlines += [w.since + self.timeout_s for w in waiting if w.state == "busy"]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self, finish) -> None:
        """Times out overrunning calls (their workers are replaced) and stuck start-ups."""
        now = time.monotonic()
        for w in list(self._workers):
            if w.state == "busy" and self.timeout_s is not None and now - w.since > self.timeout_s:
                finish(w.idx, "timeout", f"call exceeded {self.timeout_s}s; worker replaced")
                self._replace(w)
            elif w.state == "starting" and now - w.since > self.start_timeout_s:
                self.close()
                raise RuntimeError(
                    f"a reward worker did not start within {self.start_timeout_s}s")

    def _on_started(self, w: _Worker, msg) -> None:
        if msg is not None and msg[0] == "ready":
            w.state = "idle"
            return
        detail = msg[1] if msg is not None else f"it died, {_exit_status(w.process)}"
        self.close()
        names = [t.name for t in self.terms]
        raise RuntimeError(f"reward worker failed to start ({names}): {detail}")
