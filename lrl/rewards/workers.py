"""Worker processes that run host code with a per-call timeout, on one job queue.

`WorkerQueue` keeps `num_workers` processes, each handling one job at a time, so the parent
knows when every job started: a job over its time limit gets its worker killed and replaced
(a hung sympy simplification or a stuck tool cannot be interrupted any other way), and a
worker that dies mid-job is reported with its exit status and replaced. Workers come from a
forkserver (or spawn) context, never from fork: the parent has JAX loaded, and fork after
JAX's threads have started is unsafe.

A job is ("score", completion, answer, meta) — the rewards' terms, resolved once per worker
(`lrl.rewards.pool.RewardPool.score`) — or ("call", fn, args): a module-level function, which
travels by name (the worker imports its module), with picklable arguments and result.
`submit` / `poll` / `cancel` run calls without blocking (multi-turn environments,
`lrl.envs.driver`); `RewardPool.score` queues its items on the same queue, so it may run
while calls are in flight. With num_workers=0 calls run in threads of this process, abandoned
(still running) when they overrun.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import multiprocessing as mp
import multiprocessing.connection
import pickle
import signal
import threading
import time

from lrl.rewards.registry import Term, get, score_terms

_BUILTIN_MODULES = ("lrl.rewards.registry", "lrl.rewards.math", "lrl.rewards.match",
                    "lrl.rewards.format", "lrl.rewards.synthetic")


def _worker_main(conn, terms: tuple[Term, ...]) -> None:
    """Worker loop: resolve the rewards once, then answer one job per message:
    (ticket, "score", completion, answer, meta), or (ticket, "call", pickled (fn, args)),
    which is acknowledged with (ticket, "started", None) once unpickled: importing the
    function's module does not count against the call's time limit."""
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
        body = msg[2:]
        if msg[1] == "call":
            try:
                body = pickle.loads(msg[2])
            except Exception as e:  # noqa: BLE001 - e.g. its module does not import here
                body = None
                status, payload = "error", f"cannot load the call: {type(e).__name__}: {e}"
            try:
                conn.send((msg[0], "started", None))
            except OSError:
                return
        if body is not None:
            status, payload = _run_job(terms, msg[1], body)
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
    since: float  # when it started starting, or was sent / started its current job
    ticket: int = -1  # its current job
    timeout_s: float | None = None  # that job's limit
    loading: bool = False  # its call is sent, not yet started (the worker imports its module)


@dataclasses.dataclass
class _Job:
    message: tuple  # what the worker gets after the ticket: ("score", ...) or ("call", fn, args)
    timeout_s: float | None


class WorkerQueue:
    """Worker processes and their job queue (see the module docstring); `RewardPool` builds
    on it. `terms`: the rewards every worker resolves at start-up (for "score" jobs)."""

    def __init__(self, terms: tuple[Term, ...], num_workers: int, timeout_s: float | None,
                 mp_context: str, start_timeout_s: float):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if mp_context not in ("forkserver", "spawn"):
            raise ValueError(f"mp_context must be 'forkserver' or 'spawn' (fork is unsafe once JAX "
                             f"is loaded), got {mp_context!r}")
        self.terms = terms
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

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

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
        if self.num_workers == 0:  # a thread instead of the queue
            self._queue.remove(ticket)
            del self._jobs[ticket]
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
        # (every submitted ticket is queued, running, in a thread or done: there is always
        # something to wait for while `wanted` is not empty)
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
        if not waiting:  # nothing to wait for (never block on no connection at all)
            return
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
            elif msg[1] == "started":  # loaded: its time limit starts now
                w.loading, w.since = False, time.monotonic()
            else:
                self._finish(w.ticket, msg[1], msg[2])
                w.state = "idle"
        self._expire()

    def _send(self, w: _Worker) -> None:
        ticket = self._queue.popleft()
        job = self._jobs[ticket]
        message = job.message
        try:
            if message[0] == "call":  # pickled here, so that the worker can time its loading
                message = ("call", pickle.dumps(message[1:]))
            w.conn.send((ticket, *message))
        except (OSError, EOFError):  # it died while idle: not the job's fault, so retry it
            self._queue.appendleft(ticket)
            self._replace(w)
            return
        except Exception as e:  # noqa: BLE001 - meta or arguments that do not pickle
            self._finish(ticket, "error", f"cannot send it to a worker: {type(e).__name__}: {e}")
            return
        w.state, w.since, w.ticket, w.timeout_s = "busy", time.monotonic(), ticket, job.timeout_s
        w.loading = message[0] == "call"

    def _wait_s(self, waiting: list[_Worker]) -> float | None:
        """Seconds until the nearest call or start-up deadline; None if there is none."""
        deadlines = [w.since + self.start_timeout_s for w in waiting if w.state == "starting"]
        deadlines += [w.since + self._limit(w) for w in waiting
                      if w.state == "busy" and self._limit(w) is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _limit(self, w: _Worker) -> float | None:
        """The busy worker's current limit: its job's, or start-up's while it loads a call."""
        return self.start_timeout_s if w.loading else w.timeout_s

    def _expire(self) -> None:
        """Times out overrunning calls (their workers are replaced) and stuck start-ups."""
        now = time.monotonic()
        for w in list(self._workers):
            limit = self._limit(w) if w.state == "busy" else None
            if limit is not None and now - w.since > limit:
                what = "loading the call" if w.loading else "call"
                self._finish(w.ticket, "timeout", f"{what} exceeded {limit}s; worker replaced")
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
