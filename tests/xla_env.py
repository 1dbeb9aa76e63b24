"""The suite's XLA flags for code it compiles itself and for the processes it starts.

Compiling is about three quarters of the suite's time on 2 cores (jax's compile events), and
LLVM's optimisation most of a compile; the suite's programs are tiny and run a few times
each, so unoptimised code is the faster trade (two test files, 227 -> 165 s wall, 2026-12-05).
The operations are the same IEEE ones, only slower to run. Set
`--xla_backend_optimization_level` yourself in XLA_FLAGS to test optimised code.
"""
SPEED_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_speed_flags(flags: str) -> str:
    """`flags` plus SPEED_FLAGS unless they already choose an optimisation level."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {SPEED_FLAGS}".strip()
