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

The same workers run other host code without blocking (multi-turn environments,
`lrl.envs.driver`): `ticket = pool.submit(fn, *args, timeout_s=...)` queues a call of a
module-level function, `pool.poll(timeout_s)` returns the finished ones as (ticket, status,
payload), `pool.cancel(ticket)` forgets one (killing its worker if it runs). Calls and
scoring items share one queue, so `score` may run while calls are in flight.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
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
    """Worker loop: resolve the rewards once, then answer one job per message:
    (ticket, "score", completion, answer, meta) or (ticket, "call", fn, args)."""
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
        status, payload = _run_job(terms, msg[1], msg[2:])
        try:
            conn.send((msg[0], status, payload))
        except OSError:  # the parent is gone
            return
        except Exception as e:  # noqa: BLE001 - a result that does not pickle: the job's error
            conn.send((msg[0], "error", f"its result cannot be sent back: {type(e).__name__}: {e}"))


def _run_job(terms, kind: str, body: tuple) -> tuple[str, object]:
    """(status, payload) of one job: ("ok", result) or ("timeout" | "error", message)."""
    try:
        if kind == "score":
            result = score_terms(terms, *body)
        else:
            fn, args = body
            result = fn(*args)
        return "ok", result
    except TimeoutError as e:  # a reward's own time limit (e.g. math-verify's)
        return "timeout", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
        return "error", f"{type(e).__name__}: {e}"


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
    ticket: int = -1  # its current job
    timeout_s: float | None = None  # that job's limit


@dataclasses.dataclass
class _Job:
    message: tuple  # what the worker gets after the ticket: ("score", ...) or ("call", fn, args)
    timeout_s: float | None


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
        # Jobs of `score` and `submit` share one queue, so a call in flight never mixes with a
        # scoring call's items: ticket -> job while queued or running, -> (status, payload)
        # once finished and not yet collected.
        self._tickets = itertools.count()
        self._queue: collections.deque[int] = collections.deque()
        self._jobs: dict[int, _Job] = {}
        self._done: dict[int, tuple[str, object]] = {}
        self._submitted: set[int] = set()  # tickets of `submit`, returned by `poll`
        self._threads: dict[int, tuple[threading.Thread, list, float, float | None]] = {}

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
        self._queue.clear()
        self._jobs.clear()
        self._done.clear()
        self._submitted.clear()
        self._threads.clear()  # in-process calls are abandoned, as on a timeout

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

    # ----- calls without waiting ----------------------------------------------------------

    def submit(self, fn, *args, timeout_s: float | None | str = "pool") -> int:
        """Queues `fn(*args)` for a worker and returns its ticket at once; `poll` hands back
        its outcome. `fn` must be a module-level function (it travels by name and the worker
        imports its module), `args` and the result must pickle. `timeout_s`: this call's limit
        ("pool": the pool's `timeout_s`; None: none); over it, the worker is killed and
        replaced and the call's outcome is "timeout". With num_workers=0 the call runs in a
        thread of this process, abandoned (still running) if it overruns."""
        limit = self.timeout_s if timeout_s == "pool" else timeout_s
        if limit is not None and not limit > 0:
            raise ValueError(f"submit: timeout_s must be positive or None, got {limit}")
        if not callable(fn):
            raise ValueError(f"submit: {fn!r} is not callable")
        ticket = self._enqueue(("call", fn, tuple(args)), limit)
        self._submitted.add(ticket)
        if self.num_workers == 0:
            self._queue.remove(ticket)
            box: list = []
            thread = threading.Thread(target=lambda: box.append(_run_job((), "call", (fn, args))),
                                      daemon=True, name="lrl-reward-call")
            self._threads[ticket] = (thread, box, time.monotonic(), limit)
            thread.start()
        return ticket

    def poll(self, timeout_s: float | None = 0.0,
             tickets=None) -> list[tuple[int, str, object]]:
        """Outcomes of finished `submit` calls, each returned once: (ticket, status, payload)
        with status "ok" (payload: the result), "error" or "timeout" (payload: a message).
        `tickets`: only these (default: all); waits up to `timeout_s` (None: until one is
        ready) when none is, and returns [] at once when none of them is in flight."""
        wanted = self._submitted if tickets is None else self._submitted & set(tickets)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            # Every poll moves the queue on: queued calls go to idle workers, answers are read.
            if self.num_workers == 0:
                self._check_threads()
            elif self._jobs:
                self._pump(0.0)
            out = [(t, *self._done.pop(t)) for t in sorted(wanted & self._done.keys())]
            remaining = None if deadline is None else deadline - time.monotonic()
            if out or not wanted or (remaining is not None and remaining <= 0):
                self._submitted -= {t for t, *_ in out}
                return out
            if self.num_workers == 0:  # threads: look again in 5 ms
                time.sleep(0.005 if remaining is None else min(remaining, 0.005))
            else:
                self._pump(remaining)

    def cancel(self, ticket: int) -> bool:
        """Forgets a submitted call: drops it from the queue, or kills and replaces the worker
        running it (an in-process thread is abandoned). -> whether it was still in flight."""
        self._submitted.discard(ticket)
        self._done.pop(ticket, None)
        if self._threads.pop(ticket, None) is not None:
            return True
        if self._jobs.pop(ticket, None) is None:
            return False
        if ticket in self._queue:
            self._queue.remove(ticket)
            return True
        for w in self._workers:
            if w.state == "busy" and w.ticket == ticket:
                self._replace(w)
        return True

    def in_flight(self) -> int:
        """Submitted calls not yet returned by `poll`."""
        return len(self._submitted)

    def _check_threads(self) -> None:
        now = time.monotonic()
        for ticket, (thread, box, start, limit) in list(self._threads.items()):
            if box:
                self._done[ticket] = box[0]
            elif limit is not None and now - start > limit:
                self._done[ticket] = ("timeout", f"call exceeded {limit}s (in-process thread "
                                                 "left running)")
            else:
                continue
            del self._threads[ticket]

    # ----- the workers' job queue ---------------------------------------------------------

    def _enqueue(self, message: tuple, timeout_s: float | None) -> int:
        ticket = next(self._tickets)
        self._jobs[ticket] = _Job(message, timeout_s)
        self._queue.append(ticket)
        return ticket

    def _finish(self, ticket: int, outcome: str, payload) -> None:
        if self._jobs.pop(ticket, None) is not None:  # else cancelled meanwhile
            self._done[ticket] = (outcome, payload)

    def _pump(self, wait_s: float | None) -> None:
        """One round: queued jobs to idle workers, then wait (at most `wait_s`, or until the
        nearest deadline) for answers, and time out overrunning calls."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        for w in self._workers:
            if w.state == "idle" and self._queue:
                self._send(w)
        waiting = [w for w in self._workers if w.state in ("starting", "busy")]
        limits = [t for t in (wait_s, self._wait_s(waiting)) if t is not None]
        ready = mp.connection.wait([w.conn for w in waiting],
                                   timeout=min(limits) if limits else None)
        for w in [w for w in waiting if w.conn in ready]:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                msg = None
            if w.state == "starting":
                self._on_started(w, msg)
            elif msg is None:  # the worker died mid-call (segfault, os._exit, OOM kill)
                self._finish(w.ticket, "error", f"worker died, {_exit_status(w.process)}")
                self._replace(w)
            else:
                self._finish(w.ticket, msg[1], msg[2])
                w.state = "idle"
        self._expire()

    def _send(self, w: _Worker) -> None:
        ticket = self._queue.popleft()
        job = self._jobs[ticket]
        try:
            w.conn.send((ticket, *job.message))
        except (OSError, EOFError):  # it died while idle: not the job's fault, so retry it
            self._queue.appendleft(ticket)
            self._replace(w)
            return
        except Exception as e:  # noqa: BLE001 - meta or arguments that do not pickle
            self._finish(ticket, "error", f"cannot send it to a worker: {type(e).__name__}: {e}")
            return
        w.state, w.since, w.ticket, w.timeout_s = "busy", time.monotonic(), ticket, job.timeout_s

    def _wait_s(self, waiting: list[_Worker]) -> float | None:
        """Seconds until the nearest call or start-up deadline; None if there is none."""
        deadlines = [w.since + self.start_timeout_s for w in waiting if w.state == "starting"]
        deadlines += [w.since + w.timeout_s for w in waiting
                      if w.state == "busy" and w.timeout_s is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        """Times out overrunning calls (their workers are replaced) and stuck start-ups."""
        now = time.monotonic()
        for w in list(self._workers):
            if w.state == "busy" and w.timeout_s is not None and now - w.since > w.timeout_s:
                self._finish(w.ticket, "timeout", f"call exceeded {w.timeout_s}s; worker replaced")
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
