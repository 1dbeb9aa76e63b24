"""What cuDNN's packed attention (segment ids, `flash.dense_attention`) takes beside its
inputs, by the runs E a row may hold: the compiled forward and backward's temporaries, read
from XLA's memory analysis (compiled, not run), against a row without segment ids.

    python experiments/bench/packed_attention_memory.py                 # H200: 1.5B and 7B heads
    python experiments/bench/packed_attention_memory.py --lengths 8192 --runs 2,64

cuDNN's packed backward sizes its buffers as if each of the E runs were the whole row: E x T
x N x H of fp32 dQ and of bf16 dK and dV (8 bytes a run, token and query feature), which the
last column predicts. `flash.segments_for` chooses E from that count.

B rows · T tokens · N query heads · K kv heads · H head dim · E runs a row.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

HEADS = {"1.5b": (12, 2, 128), "7b": (28, 4, 128)}


def temp_gib(T: int, heads, runs: int | None, rows: int = 1) -> float:
    """Temporaries of grad(sum(attention)) for `rows` rows of T tokens, E = `runs` (None: no
    segment ids), compiled for the default device."""
    import jax
    import jax.numpy as jnp

    from lrl.models import flash
    N, K, H = heads
    q = jax.ShapeDtypeStruct((rows, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((rows, T, K, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((rows, T), jnp.int32)

    def loss(q, k, v, s):
        o = flash.dense_attention(q, k, v, s, implementation="cudnn",
                                  max_segments=runs or flash.MAX_SEGMENTS)
        return jnp.sum(o.astype(jnp.float32))

    if runs is None:
        fn = jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, None), argnums=(0, 1, 2)))
        compiled = fn.lower(q, kv, kv).compile()
    else:
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        compiled = fn.lower(q, kv, kv, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--runs", default="2,8,16,64")
    ap.add_argument("--models", default="1.5b,7b")
    a = ap.parse_args()
    import jax
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| heads | T | E | temp GiB | over no segments GiB | E x T x N x H x 8 GiB |")
    print("|---|---|---|---|---|---|")
    for model in a.models.split(","):
        heads = HEADS[model]
        for T in (int(x) for x in a.lengths.split(",")):
            base = temp_gib(T, heads, None)
            print(f"| {model} | {T} | none | {base:.2f} | | |", flush=True)
            for E in (int(x) for x in a.runs.split(",")):
                try:
                    t = temp_gib(T, heads, E)
                    print(f"| {model} | {T} | {E} | {t:.2f} | {t - base:.2f} | "
                          f"{E * T * heads[0] * heads[2] * 8 / 2**30:.2f} |", flush=True)
                except Exception as e:  # noqa: BLE001 (a compile that fails: say which)
                    print(f"| {model} | {T} | {E} | {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:80]} | | |", flush=True)


if __name__ == "__main__":
    main()
