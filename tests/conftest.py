"""The suite runs on CPU with 8 virtual devices; the flag must be set before jax loads."""
import os

from tests.xla_env import chooses_level, with_speed_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
# Unoptimised programs but for the tests marked `optimized` (`_optimization` below)
SUITE_CHOOSES_LEVEL = not chooses_level(_flags)
if SUITE_CHOOSES_LEVEL:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = with_speed_flags(_flags)   # tests/xla_env.py says why
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent compilation cache for the whole session, shared by both xdist workers and
# every process a test starts (a bench's smoke run, a notebook, `python -m lrl.main`): the tests
# build the same tiny models and steps again and again behind fresh jit closures and in fresh
# processes, and an identical program loads from disk instead of compiling. The process that
# starts the session makes a fresh folder and names it in the environment, which the workers and
# their children inherit (nothing carries over between sessions, so no test sees a program it
# did not compile this session). A size cap makes jax lock the folder while it reads or writes
# an entry, so one process never reads another's half-written program. LRL_TEST_XLA_CACHE=0
# turns it off. Runs inside tests keep their programs here too (`_one_program_cache` below).
if os.environ.get("LRL_TEST_XLA_CACHE", "1") != "0" and "LRL_TEST_XLA_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    _cache = tempfile.mkdtemp(prefix="lrl-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(LRL_TEST_XLA_CACHE_DIR=_cache, JAX_COMPILATION_CACHE_DIR=_cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.05",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    try:   # the cap's lock is `filelock`'s (torch and transformers bring it)
        import filelock  # noqa: F401
        os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(64 * 2**30)
    except ImportError:
        pass

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each module's compiled programs and their buffers go when it ends: kept for the whole
    suite they add up past a 24 GB CI machine (the OOM killer ended a run at 92%)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _optimization(request, monkeypatch):
    """Tests marked `optimized` compile at the suite's flags' level (1), in this process and
    the ones it starts: their programs run many times. The rest compile unoptimised
    (tests/xla_env.py says why)."""
    if SUITE_CHOOSES_LEVEL and request.node.get_closest_marker("optimized"):
        monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
        jax.config.update("jax_disable_most_optimizations", False)
        yield
        jax.config.update("jax_disable_most_optimizations", True)
    else:
        yield


@pytest.fixture(autouse=True)
def _one_program_cache(request, monkeypatch):
    """A run inside a test (`lrl.loop.run`, whose `compile_cache` is "auto": a fresh
    `.lrl-cache` beside each test's workdir) keeps its programs in the suite's cache above, so
    the next test's run loads the tiny model's programs this one compiled; its budgets still go
    to its own folder. Tests of the cache itself (`@pytest.mark.own_compile_cache`) keep the
    run's own folder, as a user's run has it."""
    suite = os.environ.get("LRL_TEST_XLA_CACHE_DIR")
    if suite and not request.node.get_closest_marker("own_compile_cache"):
        from lrl import compile_cache
        monkeypatch.setattr(compile_cache.Cache, "jax_path",
                            property(lambda self: suite if self.path else None))
    yield


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
