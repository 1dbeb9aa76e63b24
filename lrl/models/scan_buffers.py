"""Stacked scan outputs without a zero fill.

jax lowers `lax.scan` so that every stacked output (`[L, ...]` over the layers: the residuals a
remat policy saves, the weights' gradients in the backward scan) starts as a broadcast zero,
which the loop then overwrites element by element. XLA keeps the fill, HBM-bound work of its
own in every update step, and lowering without it made the step faster on one GPU
(docs/benchmark-history.md, "Keeping the attention residuals" for the profile, "Uninitialised scan
buffers, fifth session", and "Measurements once quoted in the code").
jax means to allocate them uninitialised (`lax.empty`, XLA's AllocateBuffer custom call on GPU
and TPU; see the TODO in `jax/_src/lax/control_flow/loops.py::_empty_array`) but does not yet.

`uninitialised_scan_outputs()` makes that change for the programs lowered inside it. It
replaces jax's private `_empty_array` for the duration and so depends on jax's internals: where
the function is missing it changes nothing and says so. jax caches lowerings by function: a
function lowered inside keeps that lowering outside, and one lowered before keeps jax's.
"""
from __future__ import annotations

import contextlib
import importlib
import threading

import jax

_LOCK = threading.Lock()
# The patch is process-wide (jax's module attribute) but acts only in the threads inside the
# context: a program another thread lowers meanwhile (the rollout's, while the update's next
# shapes compile on a thread, `lrl.compiles.Background`) keeps jax's lowering, so its
# persistent-cache key does not depend on timing.
_LOCAL = threading.local()
_ACTIVE = [0, None]   # threads inside the context, jax's own `_empty_array`


def _inside() -> bool:
    return getattr(_LOCAL, "depth", 0) > 0


def _uninitialised(original):
    from jax._src import core

    def empty_array(prefix, length_spec, aval):
        zeros = original(prefix, length_spec, aval)   # its aval carries jax's sharding rules
        if not _inside():
            return zeros
        if getattr(aval, "memory_space", None) not in (None, core.MemorySpace.Device):
            return zeros                              # host-offloaded stacks keep jax's way
        out = jax.lax.empty(zeros.shape, zeros.dtype, out_sharding=zeros.aval.sharding)
        return core.pvary(out, tuple(aval.mat.varying))   # the unused zeros are dead code

    return empty_array


@contextlib.contextmanager
def uninitialised_scan_outputs(enabled: bool = True):
    """Lower scans with uninitialised stacked outputs while inside (this thread's lowerings
    only); yields whether it could."""
    loops = importlib.import_module("jax._src.lax.control_flow.loops")
    if not enabled or getattr(loops, "_empty_array", None) is None or not hasattr(jax.lax,
                                                                                 "empty"):
        yield False
        return
    with _LOCK:
        if _ACTIVE[0] == 0:
            _ACTIVE[1] = loops._empty_array
            loops._empty_array = _uninitialised(_ACTIVE[1])
        _ACTIVE[0] += 1
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield True
    finally:
        _LOCAL.depth -= 1
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                loops._empty_array = _ACTIVE[1]


class UninitialisedScanJit:
    """A jitted function whose programs are lowered inside `uninitialised_scan_outputs`:
    calling it (the first call lowers) and `.lower(...)` both are; everything else is the
    jitted function's own."""

    def __init__(self, jitted):
        self._jitted = jitted

    def __call__(self, *args, **kwargs):
        with uninitialised_scan_outputs():
            return self._jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with uninitialised_scan_outputs():
            return self._jitted.lower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)
