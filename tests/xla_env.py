"""The suite's XLA flags for code it compiles itself and for the processes it starts.

Compiling is about three quarters of the suite's time on 2 cores (jax's compile events), and
LLVM's optimisation most of a compile; the suite's programs are tiny and run a few times
each, so unoptimised code is the faster trade (two test files, 227 -> 165 s wall, 2026-12-05).
On jaxlib 0.10 the CPU backend's fusion emitters (MLIR) take most of what is left: the older
elemental emitter compiles the same fusions in less than half the time (one ring test's
compile, 18.8 -> 7.5 s, 2026-12-06). jaxlib 0.11 dropped that flag and dies on an unknown one,
so it is set on jaxlib 0.10 only, the version it was measured on. The operations are the same
IEEE ones, only slower to run. Set `--xla_backend_optimization_level` yourself in XLA_FLAGS to
test optimised code.

Unoptimised code is the faster trade only where compiling is most of a test. A test whose
programs run many times (a multi-turn rollout over several steps) runs them 5-8 times slower
unoptimised: the partial tools loop took 172 s unoptimised and 98 s at LLVM's level 1
(2026-12-07), and the whole suite 27 min unoptimised, 39 at level 1. So the flags ask for
level 1 and jax's `jax_disable_most_optimizations` (read at each compile) takes it to 0 for
every test but those marked `@pytest.mark.optimized` (tests/conftest.py); the processes a test
starts inherit the choice through JAX_DISABLE_MOST_OPTIMIZATIONS.
"""
import importlib.metadata
import os
import re


def _jaxlib_version() -> tuple:
    try:
        return tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0, 0)


SPEED_FLAGS = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
if _jaxlib_version() == (0, 10):
    SPEED_FLAGS += " --xla_cpu_use_fusion_emitters=false"


def with_speed_flags(flags: str) -> str:
    """`flags` plus SPEED_FLAGS unless they already choose an optimisation level."""
    if chooses_level(flags):
        return flags
    return f"{flags} {SPEED_FLAGS}".strip()


def chooses_level(flags: str) -> bool:
    """Whether XLA_FLAGS `flags` set the optimisation level themselves (then the suite leaves
    every compile at it)."""
    return "xla_backend_optimization_level" in flags.replace(SPEED_FLAGS, "")


def one_device_env(**extra) -> dict:
    """The environment for a bench's `--smoke` process: this one's, on CPU, without the suite's
    8 virtual devices (a bench's rows run on one device)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")).strip()
    return env
