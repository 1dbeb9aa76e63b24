"""What makes a run's second start fast: JAX's persistent compilation cache (every compiled
program, and on GPU XLA's autotuning results, kept on disk and loaded by the next process that
compiles the same program) and the update's micro-batch budget, found once by compiling the
update at a few shapes (`lrl.rl.budget.resolve`) and kept beside the programs, so a rerun or a
resume skips both the compiles and the search.

`config.compile_cache`: "auto" puts the cache in `.lrl-cache` beside the workdir (one cache
for the runs under one folder, which is where reruns and sweeps go); a path puts it there;
"" turns both off. The cache is trusted (JAX loads executables from it): keep it where only
you can write.

    with compile_cache.enabled(compile_cache.folder(opts.compile_cache, workdir)) as cache:
        ...   # cache.hits: programs loaded from disk so far
        budget = compile_cache.load_budget(cache.path, key)
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from typing import Optional

import jax

log = logging.getLogger(__name__)

# Programs that compile faster than this are not written (jax's default is 1 s). A tenth of a
# second keeps the many small programs of a step (the sampler's, the packing's) too: on a CPU
# the start-up is mostly those.
MIN_COMPILE_SECONDS = 0.1
BUDGETS = "budgets.json"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def folder(setting: str, workdir: str) -> Optional[str]:
    """The cache folder for `config.compile_cache` (None: off)."""
    if not setting:
        return None
    if setting == "auto":
        return os.path.join(os.path.dirname(os.path.abspath(workdir)), ".lrl-cache")
    return os.path.abspath(os.path.expanduser(setting))


@dataclasses.dataclass
class Cache:
    path: Optional[str]   # None: off
    hits: int = 0         # programs loaded from the cache since it was enabled

    @property
    def jax_path(self) -> Optional[str]:
        return os.path.join(self.path, "jax") if self.path else None

    def describe(self) -> str:
        if not self.path:
            return "off (--config.compile_cache=auto keeps compiled programs for the next start)"
        return f"{self.path} (--config.compile_cache='' turns it off)"


def _settings() -> dict:
    c = jax.config
    return {"jax_compilation_cache_dir": c.jax_compilation_cache_dir,
            "jax_persistent_cache_min_compile_time_secs":
                c.jax_persistent_cache_min_compile_time_secs,
            "jax_persistent_cache_min_entry_size_bytes":
                c.jax_persistent_cache_min_entry_size_bytes}


def _apply(settings: dict) -> None:
    from jax._src import compilation_cache as cc   # the cache reads its folder once: reset it
    for k, v in settings.items():
        jax.config.update(k, v)
    cc.reset_cache()


@contextlib.contextmanager
def enabled(path: Optional[str]):
    """JAX's persistent compilation cache in `path`/jax while the block runs (the process's
    own settings come back after it: a run inside a larger program, a test, leaves them as
    they were); yields a `Cache` that counts the programs loaded from it. `path` None: off,
    unless the process set a cache of its own (`JAX_COMPILATION_CACHE_DIR`), which is kept."""
    cache = Cache(path)
    if path is None:
        yield cache
        return
    before = _settings()
    try:
        os.makedirs(cache.jax_path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile_cache={path!r}: cannot create the cache folder ({e}); set "
                         "--config.compile_cache to a writable folder, or '' to turn it off"
                         ) from e

    def count(event, **kw):
        if event == _HIT_EVENT:
            cache.hits += 1

    _apply({"jax_compilation_cache_dir": cache.jax_path,
            "jax_persistent_cache_min_compile_time_secs": MIN_COMPILE_SECONDS,
            "jax_persistent_cache_min_entry_size_bytes": 0})
    jax.monitoring.register_event_listener(count)
    try:
        yield cache
    finally:
        from jax._src import monitoring
        monitoring.unregister_event_listener(count)
        _apply(before)


# ----------------------------------------------------------------------------- budgets

def budget_key(**parts) -> str:
    """A hash of everything the update's memory depends on (the caller names the parts: the
    model and update configs, mesh, remat and dtypes, row settings, device kind and memory,
    jax version): a change to any of them searches again."""
    text = json.dumps({k: repr(v) for k, v in sorted(parts.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_budget(path: Optional[str], key: str) -> Optional[dict]:
    """The budget a run with the same key found, or None (no cache, none saved, unreadable)."""
    if not path:
        return None
    try:
        with open(os.path.join(path, BUDGETS)) as f:
            return json.load(f).get(key)
    except (OSError, ValueError) as e:
        if not isinstance(e, FileNotFoundError):
            log.info("compile cache: %s unreadable (%s); searching again", BUDGETS, e)
        return None


def save_budget(path: Optional[str], key: str, entry: dict) -> None:
    """Adds `entry` under `key` (written whole to a temporary file, then renamed: two runs
    saving at once leave one of their files, never half of one). Process 0 only."""
    if not path or jax.process_index() != 0:
        return
    file = os.path.join(path, BUDGETS)
    try:
        with open(file) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        entries = {}
    entries[key] = entry
    tmp = f"{file}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as e:   # a read-only cache still runs: it searches each start
        log.warning("compile cache: cannot save the micro-batch budget to %s (%s)", file, e)
