"""Whether the checkpoints of a run fit its disk: said at start-up, and as the reason when a
write fails for want of space.

A 7B state with fp32 masters and Adam moments is ~100 GiB a checkpoint; a 64 GiB disk takes
none of it, and finding out at the first save wastes the steps before it. The size of a save
to come is the newest saved step's size on disk when there is one (orbax compresses with zstd,
so that is the best guess), else the state's bytes as held (an upper bound: zeroed moments
compress to nothing, weights by a few percent).
"""
from __future__ import annotations

import errno
import math
import os
import shutil
from typing import Optional

import jax
import numpy as np

GiB = 2 ** 30


def size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


def tree_bytes(*trees) -> int:
    """Bytes of the arrays (or `jax.ShapeDtypeStruct`s) in `trees`, at their global shapes."""
    n = 0
    for x in jax.tree.leaves(trees):
        if not hasattr(x, "shape"):
            continue
        try:
            item = np.dtype(x.dtype).itemsize
        except TypeError:     # a typed PRNG key: stored as its key data, a few words
            item = 8
        n += math.prod(x.shape) * item
    return n


def _local(directory) -> Optional[str]:
    """The nearest existing folder of a local path; None for a remote one (gs://...)."""
    path = os.fspath(directory)
    if "://" in path:
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def free_bytes(directory) -> Optional[int]:
    """Free bytes on the disk `directory` is (or will be) on; None when not a local disk."""
    path = _local(directory)
    return None if path is None else shutil.disk_usage(path).free


def dir_bytes(path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(os.fspath(path)):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:     # removed while walking (an old step deleted by keep-last-N)
                pass
    return total


def estimate(directory, steps: list[int], state_bytes: int) -> tuple[int, str]:
    """(bytes, where the number comes from) of the next save in `directory`."""
    if steps:
        return dir_bytes(os.path.join(os.fspath(directory), str(steps[-1]))), \
            f"step {steps[-1]} takes"
    return state_bytes, "the state's arrays hold (before orbax's compression)"


def warning(directory, keep: int, steps: list[int], state_bytes: int,
            weights_bytes: int = 0) -> Optional[str]:
    """A message when the disk cannot hold the saves to come, else None. Keeping `keep` steps
    needs room for `keep + 1` while a save is written (the oldest goes once it commits).
    `weights_bytes` (0 = not offered): a save of the weights only, suggested where it fits."""
    free = free_bytes(directory)
    if free is None:
        return None
    need, basis = estimate(directory, steps, state_bytes)
    more = max(1, keep + 1 - len(steps))
    if need == 0 or free >= more * need:
        return None
    which = ("the next save cannot fit" if free < need else
             f"the next save fits, but keeping {keep} needs room for {more}")
    light = ""
    if weights_bytes and free >= more * weights_bytes:
        light = (f", or save the weights only (checkpoint.contents=weights: "
                 f"{size(weights_bytes)} a save; a resume then restarts the optimizer)")
    return (f"checkpoints: {which}: {os.fspath(directory)} has {size(free)} free and "
            f"{basis} {size(need)}. Free space, point --workdir at a larger disk, "
            f"keep fewer (checkpoint.keep={keep}){light}; a save that runs out of space stops "
            "the run and loses the steps since the last one")


def no_space(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from, is a full disk (ENOSPC)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):   # tensorstore's errors carry only the text
            return True
        e = e.__cause__ or e.__context__
    return False
