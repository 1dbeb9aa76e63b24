"""SIGTERM-safe training: the scheduler's notice becomes a flag the loop polls, agreed across
processes so every host saves and stops at the same step."""
from __future__ import annotations

import logging
import signal
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def agree_any(flag: bool) -> bool:
    """True on every process when it is True on any (decisions that gate a collective save)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


class PreemptionGuard:
    """Turns SIGTERM (the scheduler's notice) into a flag that the loop polls.

    `should_stop(step)` is True, on every process at the same step, once any process got the
    signal or JAX's preemption sync point (multi-host runs with the coordination service)
    is reached; the loop then saves and exits.
    """

    def __init__(self, signals=(signal.SIGTERM,)):
        self.signals = tuple(signals)
        self._event = threading.Event()
        self._previous = {}

    def _handler(self, signum, frame):
        if not self._event.is_set():
            log.warning("received %s: will save a checkpoint and stop after this step",
                        signal.Signals(signum).name)
        self._event.set()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handler)
        else:
            log.warning("PreemptionGuard outside the main thread: signals are not caught")
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self) -> None:
        """Asks for a stop as if the signal had arrived (tests, custom triggers)."""
        self._event.set()

    def should_stop(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.requested
        # Every process calls both, every step: each is a cross-host agreement.
        return agree_any(self.requested) or ocp.multihost.reached_preemption(step)
