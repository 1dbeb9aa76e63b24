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

_LOCK = threading.RLock()   # reentrant: a step may be lowered inside another's context


def _uninitialised(original):
    from jax._src import core

    def empty_array(prefix, length_spec, aval):
        zeros = original(prefix, length_spec, aval)   # its aval carries jax's sharding rules
        if getattr(aval, "memory_space", None) not in (None, core.MemorySpace.Device):
            return zeros                              # host-offloaded stacks keep jax's way
        out = jax.lax.empty(zeros.shape, zeros.dtype, out_sharding=zeros.aval.sharding)
        return core.pvary(out, tuple(aval.mat.varying))   # the unused zeros are dead code

    return empty_array


@contextlib.contextmanager
def uninitialised_scan_outputs(enabled: bool = True):
    """Lower scans with uninitialised stacked outputs while inside; yields whether it could."""
    loops = importlib.import_module("jax._src.lax.control_flow.loops")
    original = getattr(loops, "_empty_array", None)
    if not enabled or original is None or not hasattr(jax.lax, "empty"):
        yield False
        return
    with _LOCK:
        loops._empty_array = _uninitialised(original)
        try:
            yield True
        finally:
            loops._empty_array = original


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
