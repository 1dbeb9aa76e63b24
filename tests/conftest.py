"""The suite runs on CPU with 8 virtual devices; the flag must be set before jax loads."""
import os

from tests.xla_env import with_speed_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = with_speed_flags(_flags)   # tests/xla_env.py says why
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent compilation cache for the whole session: the tests build the same tiny
# models and steps again and again behind fresh jit closures, and an identical program loads
# from disk instead of compiling. A fresh folder each session (nothing carries over between
# runs, so no test sees a program it did not compile this session); LRL_TEST_XLA_CACHE=0
# turns it off. Runs that enable their own cache (`lrl.compile_cache.enabled`) switch to
# theirs while they run and back after.
if os.environ.get("LRL_TEST_XLA_CACHE", "1") != "0":
    _cache = tempfile.mkdtemp(prefix="lrl-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each module's compiled programs and their buffers go when it ends: kept for the whole
    suite they add up past a 24 GB CI machine (the OOM killer ended a run at 92%)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(optionalhook=True)   # xdist's hook: without xdist (`-p no:xdist`) unused
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's and CI's command): one worker a core, at most one per ~8 GB
    of memory (a worker holds its own 8 virtual devices' programs, a loop test a few GB) and
    at most 4 (beyond that the slowest test files set the time)."""
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gb = 16.0
    return max(1, min(os.cpu_count() or 1, int(memory_gb // 8), 4))
