"""Multi-process start-up and failure handling for runs over several hosts (or several
processes on one host).

`initialize(cfg)` starts `jax.distributed` once per process, before any device is touched:
  * coordinator address, process count and id come from the config or, left empty, from JAX's
    own detection (SLURM, Open MPI, cloud TPU, `JAX_COORDINATOR_ADDRESS`);
  * every timeout is bounded and configurable: when a peer stops sending heartbeats for
    `heartbeat_timeout_s`, JAX's coordination service terminates the surviving processes with
    "Terminating process because the JAX distributed service detected fatal errors. This most
    likely indicates that another task died";
  * CPU runs get cross-process collectives (gloo), without which a multi-process CPU mesh
    cannot run a single psum;
  * a process that fails with a Python exception prints it and exits at once, instead of
    waiting up to `shutdown_timeout_s` at JAX's shutdown barrier while its peers block in the
    next collective.

Heartbeats cannot see a peer that is alive but stuck (a deadlock, an endless reward function,
a hung NCCL kernel): the others then wait in a collective forever. The watchdog covers that:
the loop calls `beat(label)` after each step, and a process that sees no beat for
`watchdog_s` seconds dumps every thread's stack and exits with `WATCHDOG_EXIT_CODE` and a
message naming the last step it finished. It is armed by the first beat, so start-up and the
first compilation are never cut short.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import sys
import threading
import time
from typing import Callable, Mapping

import jax
import numpy as np

from lrl import schema

log = logging.getLogger(__name__)

# Every field of `config.distributed`, with its default (declared in `lrl.schema.Distributed`).
# Configs may leave out any but `enabled`; an unknown field is an error naming it.
DEFAULTS: Mapping[str, object] = {f.name: f.default for f in schema.fields(schema.Distributed)}
WATCHDOG_EXIT_CODE = 75      # EX_TEMPFAIL: the job may be restarted from its last checkpoint
FAILED_EXIT_CODE = 1


def settings(cfg) -> dict:
    """The config's distributed fields over `DEFAULTS`; unknown keys and values out of their
    bounds (`lrl.schema.Distributed`) fail with their name."""
    given = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"config.distributed: unknown field(s) {unknown}; the fields are "
                         f"{sorted(DEFAULTS)}")
    out = {**DEFAULTS, **given}
    for f in schema.fields(schema.Distributed):
        schema.check_value(f"config.distributed.{f.name}", out[f.name], f.metadata)
    return out


def _device_ids(text: str) -> list[int] | None:
    text = str(text).strip()
    if not text:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"config.distributed.local_device_ids={text!r}: expected "
                         "comma-separated integers such as '0,1,2,3'") from None


def initialize_kwargs(s: Mapping[str, object]) -> dict:
    """`jax.distributed.initialize` arguments from resolved settings (empty = detect)."""
    kwargs = dict(initialization_timeout=int(s["initialization_timeout_s"]),
                  heartbeat_timeout_seconds=int(s["heartbeat_timeout_s"]),
                  shutdown_timeout_seconds=int(s["shutdown_timeout_s"]))
    if s["coordinator_address"]:
        kwargs["coordinator_address"] = str(s["coordinator_address"])
    if int(s["num_processes"]) > 0:
        kwargs["num_processes"] = int(s["num_processes"])
    if int(s["process_id"]) >= 0:
        kwargs["process_id"] = int(s["process_id"])
    ids = _device_ids(s["local_device_ids"])
    if ids is not None:
        kwargs["local_device_ids"] = ids
    return kwargs


def initialize(cfg) -> bool:
    """Starts jax.distributed when `cfg.enabled`; returns whether a multi-process runtime is up.

    Call it before anything touches a device (the CPU collectives are fixed when the backend
    starts). Calling it again once started only logs.
    """
    s = settings(cfg)
    if not s["enabled"]:
        return False
    if jax.distributed.is_initialized():
        log.info("jax.distributed already started: process %d of %d", jax.process_index(),
                 jax.process_count())
        return True
    jax.config.update("jax_cpu_collectives_implementation",
                      None if s["cpu_collectives"] == "none" else s["cpu_collectives"])
    jax.distributed.initialize(**initialize_kwargs(s))
    log.info("jax.distributed: process %d of %d, %d local devices of %d",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    if jax.process_count() > 1:
        install_fail_fast()
    if float(s["watchdog_s"]) > 0:
        start_watchdog(float(s["watchdog_s"]))
    return True


# ----------------------------------------------------------------------------- host agreement

def allgather_objects(obj) -> list:
    """Every process's `obj` (any picklable value), in process order, on every process.

    For host-side data that must be the same everywhere before it enters a jitted function:
    every process of a multi-controller run must launch the same programs on the same
    global inputs (e.g. the prompts a rollout decodes).
    """
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(every[i, :int(sizes.reshape(-1)[i])].tobytes())
            for i in range(every.shape[0])]


def max_over_processes(n: int) -> int:
    """The largest `n` over all processes (e.g. packed rows, so every process sends as many)."""
    if jax.process_count() == 1:
        return int(n)
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.asarray(int(n), np.int32))))


# ----------------------------------------------------------------------------- failing fast

def _flush_all() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # a broken handler must not stop the exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def install_fail_fast() -> None:
    """An uncaught exception prints its traceback, then ends the process at once.

    Without this the interpreter's exit runs `jax.distributed.shutdown`, which waits for every
    peer at a barrier for up to `shutdown_timeout_s` while those peers sit in the next
    collective; exiting closes this process's connections, so the peers fail within a
    heartbeat instead.
    """
    if getattr(sys.excepthook, "_lrl_fail_fast", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if issubclass(exc_type, KeyboardInterrupt):
            code = 130
        else:
            code = FAILED_EXIT_CODE
        sys.stderr.write(f"lrl.distributed: process {jax.process_index()} of "
                         f"{jax.process_count()} failed ({exc_type.__name__}); exiting now so "
                         "that its peers stop too.\n")
        _flush_all()
        os._exit(code)

    hook._lrl_fail_fast = True
    sys.excepthook = hook


# ----------------------------------------------------------------------------- the watchdog

class Watchdog:
    """Exits the process when `beat` has not been called for `timeout_s` seconds (once armed by
    the first beat). `on_timeout(message)` replaces the exit, for tests."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None] | None = None,
                 poll_s: float | None = None):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._on_timeout = on_timeout or _exit_stuck
        self._poll_s = poll_s if poll_s is not None else min(5.0, self.timeout_s / 4)
        self._last: float | None = None
        self._label = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lrl-watchdog", daemon=True)
        self._thread.start()

    def beat(self, label: str = "") -> None:
        self._last, self._label = time.monotonic(), label

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            last = self._last
            if last is None:
                continue
            idle = time.monotonic() - last
            if idle > self.timeout_s:
                where = f"after {self._label!r}" if self._label else "after the last beat"
                self._on_timeout(
                    f"lrl.distributed: process {jax.process_index()} of {jax.process_count()}: "
                    f"no progress for {idle:.0f} s {where} (watchdog_s={self.timeout_s:g}). A "
                    "peer process has probably died or hangs, leaving this one blocked in a "
                    "collective; see the other processes' logs. Exiting with code "
                    f"{WATCHDOG_EXIT_CODE}.")
                return


def _exit_stuck(message: str) -> None:
    sys.stderr.write(message + "\nStacks of this process:\n")
    _flush_all()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    _flush_all()
    os._exit(WATCHDOG_EXIT_CODE)


_WATCHDOG: list[Watchdog] = []  # the process's watchdog, like jax.distributed's own state


def start_watchdog(timeout_s: float) -> Watchdog:
    """Starts (or restarts with a new timeout) the process-wide watchdog that `beat` feeds."""
    stop_watchdog()
    _WATCHDOG.append(Watchdog(timeout_s))
    log.info("watchdog: a process exits when no step finishes for %g s", timeout_s)
    return _WATCHDOG[0]


def stop_watchdog() -> None:
    while _WATCHDOG:
        _WATCHDOG.pop().stop()


def beat(label: str = "") -> None:
    """Reports progress (call after each step); a no-op when no watchdog runs."""
    if _WATCHDOG:
        _WATCHDOG[0].beat(label)
