"""Host-side bookkeeping of the paged KV cache: the pool's free list and reference counts, how
many pages a prompt or a sample needs, and how large a pool fits in memory.

The device holds the pages themselves (`lrl.rollout.steps.DecodeState`); this module only
decides which page ids are in use. Page 0 is the null page: it is never handed out, idle slots
and padding tokens write into it, and every unused page-table entry points at it.

B batch rows · T query positions · Y pages per slot.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lrl.models.config import ModelConfig

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for (wait for frees, or grow the pool)."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-int(num_tokens) // int(page_size))


class PagePool:
    """Free list and reference counts of a pool of `num_pages` pages (page 0 reserved).

    A page is in use while its count is positive: the prompt's full pages are counted once per
    sample that reads them plus once for the prompt itself until all its samples are inserted.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is the null page), "
                             f"got num_pages={num_pages}")
        self.num_pages = int(num_pages)
        self.refcount = np.zeros(self.num_pages, np.int32)
        self.allocated_total = 0   # pages handed out over the pool's life (for statistics)
        # Popped from the end: low ids are handed out first, which keeps runs repeatable.
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with reference count 1."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.capacity} free")
        pages = [self._free.pop() for _ in range(n)]
        self.allocated_total += n
        self.refcount[pages] = 1
        return pages

    def share(self, pages) -> None:
        """One more reader of pages already in use."""
        pages = np.asarray(pages, np.int64)
        if pages.size == 0:
            return
        if np.any(pages == NULL_PAGE) or np.any(self.refcount[pages] <= 0):
            raise ValueError(f"cannot share pages that are not in use: {pages.tolist()}")
        np.add.at(self.refcount, pages, 1)

    def release(self, pages) -> list[int]:
        """Drops one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            p = int(p)
            if p == NULL_PAGE or self.refcount[p] <= 0:
                raise ValueError(f"page {p} released but it is not in use (double free?)")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed

    def all_free(self) -> bool:
        return self.num_free == self.capacity and not self.refcount.any()


def kv_bytes_per_token(cfg: ModelConfig, dtype=None) -> int:
    """Bytes of K and V, all layers, for one token."""
    itemsize = np.dtype(dtype or cfg.dtype).itemsize
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


def num_pages_for_tokens(pool_tokens: int, page_size: int) -> int:
    """Pool size (null page included) that holds `pool_tokens` tokens."""
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be positive, got {pool_tokens}")
    return pages_for(pool_tokens, page_size) + 1


def num_pages_for_memory(cfg: ModelConfig, page_size: int, fraction: float, device=None,
                         kv_shards: int = 1) -> int:
    """Pool size that takes `fraction` of the device's free memory now.

    `kv_shards` is how many devices split each page (the kv heads over the tensor axis).
    Only backends that report memory statistics (GPU, TPU) can size a pool this way.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"pool fraction must be in (0, 1], got {fraction}")
    import jax
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(f"device {device} reports no memory statistics; size the page pool "
                         f"in tokens (pool_tokens=...) instead of a memory fraction")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    page_bytes = kv_bytes_per_token(cfg) * page_size // max(kv_shards, 1)
    pages = int(free * fraction) // page_bytes
    if pages < 2:
        raise ValueError(f"{fraction:.0%} of the {free / 2**30:.2f} GiB free on {device} holds "
                         f"{pages} pages of {page_bytes} bytes; the pool needs at least 2")
    return pages


def page_of(table_BY, pos_BT, valid_BT, page_size):
    """(page, offset) of each token position in its row's page table; invalid tokens and
    positions past the table go to the null page (written there, never read)."""
    Y = table_BY.shape[1]
    idx = jnp.clip(pos_BT // page_size, 0, Y - 1)
    page = jnp.take_along_axis(table_BY, idx, axis=1)
    valid_BT = valid_BT & (pos_BT // page_size < Y)
    return jnp.where(valid_BT, page, NULL_PAGE), pos_BT % page_size
