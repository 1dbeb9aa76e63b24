"""Decode attention alone: the paged kernels' time and KV bandwidth over a sweep of settings.

A decode step of Qwen2.5-1.5B runs 28 layers of one-query attention over the paged pool;
at 256 slots that is nearly half the step. This times exactly that: 28 calls per jitted
function, one per layer base of one pool [K, L * num_pages, page_size, H], each row's pages
scattered over the pool (as after continuous batching has churned it). Reported per setting:
µs per layer and the KV read rate (bytes of the rows' live K and V over the time), against
the measured 4.1 TB/s. Every setting's output is checked against the XLA path first.

    python experiments/bench/decode_attention.py                     # H200: the sweep
    python experiments/bench/decode_attention.py --smoke             # CPU: interpret mode

B batch rows · N query heads · K key/value heads · H head dim · L layers · Y pages per slot.
"""
from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere


def case_lengths(case: str, seed: int = 0) -> np.ndarray:
    """"BxLENGTH" -> B rows of LENGTH tokens; "BxMEAN~CAP" -> B lengths drawn log-normal
    (sigma 1, mean MEAN before the cap at CAP), as a partial rollout's decode rows are after
    carried samples fill the slots (experiments/bench/grpo_step.py draws responses so)."""
    B, spec = case.split("x")
    B = int(B)
    if "~" not in spec:
        return np.full(B, int(spec), np.int32)
    mean, cap = (int(v) for v in spec.split("~"))
    rng = np.random.RandomState(seed)
    drawn = rng.lognormal(np.log(mean) - 0.5, 1.0, B)
    return np.clip(drawn.round(), 1, cap).astype(np.int32)


def make_case(lengths, N, K, H, L, page_size, Y, seed=0):
    """A pool holding only the rows' live pages, scattered (page 0 is the engine's null page,
    where the rest of each row's table points), K, V and q drawn on the device."""
    import jax
    import jax.numpy as jnp
    B = len(lengths)
    rng = np.random.RandomState(seed)
    used = -(-np.asarray(lengths) // page_size)
    num_pages = int(used.sum()) + 1
    order = 1 + rng.permutation(num_pages - 1)
    table = np.zeros((B, Y), np.int32)
    for b, start in enumerate(np.concatenate([[0], np.cumsum(used)[:-1]])):
        table[b, :used[b]] = order[start:start + used[b]]
    kk, kv, kq = jax.random.split(jax.random.PRNGKey(seed), 3)
    pool = (K, L * num_pages, page_size, H)
    return (jax.random.normal(kq, (L, B, 1, N, H), jnp.bfloat16),
            jax.random.normal(kk, pool, jnp.bfloat16), jax.random.normal(kv, pool, jnp.bfloat16),
            jnp.asarray(table), jnp.asarray(lengths, jnp.int32), num_pages)


def layered(attend, L, num_pages):
    """One jitted function calling `attend` once per layer, as the unrolled decode step does."""
    import jax

    @jax.jit
    def f(q_LB1NH, k_pages, v_pages, table, lengths):
        return [attend(q_LB1NH[layer], k_pages, v_pages, table, lengths, layer * num_pages)
                for layer in range(L)]
    return f


def settings(a):
    grid = itertools.product(a.impls, a.block_pages, a.warps, a.stages, a.splits, a.kv_per_program)
    return [dict(impl=i, pages_per_block=bp, warps=w, stages=s, k_splits=k,
                 **({"kv_per_program": j} if i == "pallas_gqa" else {}))
            for i, bp, w, s, k, j in grid if i == "pallas_gqa" or j == a.kv_per_program[0]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny, Pallas in interpret mode (CPU)")
    ap.add_argument("--cases", default="256x640,16x8448",
                    help="BxLENGTH or BxMEAN~CAP (log-normal lengths),...: rows and their kv lengths")
    ap.add_argument("--impls", default="pallas_gqa,pallas",
                    help="GPU kernels: pallas_gqa (lrl.rollout.paged_kernel), pallas (jax's)")
    ap.add_argument("--block-pages", default="2,4,8", help="pages per compute block")
    ap.add_argument("--kv-per-program", default="1,2", help="pallas_gqa: kv heads a program")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--splits", default="1,2,4", help="kv splits (16 rows: x8 each)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--hbm-tbs", type=float, default=4.1)
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    a.block_pages, a.warps, a.stages, a.splits, a.kv_per_program = map(
        ints, (a.block_pages, a.warps, a.stages, a.splits, a.kv_per_program))
    a.impls = [i for i in a.impls.split(",") if i]

    import jax
    import jax.numpy as jnp
    from experiments.bench.profile import timed
    from lrl.rollout import paged_attention as pa

    N, K, H, L = (4, 2, 16, 2) if a.smoke else (12, 2, 128, 28)
    cases = ["4x40", "4x24~40"] if a.smoke else a.cases.split(",")
    interpret = a.smoke or jax.default_backend() != "gpu"
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, N={N} K={K} H={H} "
          f"L={L} page {a.page_size}", flush=True)
    rows = []
    for case in cases:
        lengths = case_lengths(case)
        B = len(lengths)
        few = B < 64
        align = max(a.block_pages) * max(a.splits) * (8 if few else 1)
        Y = -(-int(lengths.max()) // a.page_size)
        Y = -(-Y // align) * align              # a multiple of every block x split tried
        q, kp, vp, table, lengths, num_pages = make_case(lengths, N, K, H, L, a.page_size, Y)
        kv_bytes = 2 * int(lengths.sum()) * K * H * kp.dtype.itemsize   # a layer's live K, V
        ref_f = layered(lambda q, k, v, t, n, base: pa.decode_attention(
            q, k, v, t, n, base, impl="xla", pages_per_block=8), L, num_pages)
        ref = jax.block_until_ready(ref_f(q, kp, vp, table, lengths))
        sweep = [dict(impl="xla", pages_per_block=8)] + settings(a)
        for s in sweep:
            if few and s.get("k_splits"):
                s = dict(s, k_splits=s["k_splits"] * 8)   # few rows need splits to fill the GPU
            kw = dict(s)
            impl = kw.pop("impl")
            if impl in pa.PALLAS and interpret:
                impl += "_interpret"
            f = layered(lambda q, k, v, t, n, base, kw=kw, impl=impl: pa.decode_attention(
                q, k, v, t, n, base, impl=impl, **kw), L, num_pages)
            try:
                out = jax.block_until_ready(f(q, kp, vp, table, lengths))
                err = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
                          for o, r in zip(out, ref))
                sec = timed(f, q, kp, vp, table, lengths, repeats=1 if a.smoke else a.repeats) / L
            except Exception as e:  # noqa: BLE001 - a setting the kernel rejects is reported
                print(json.dumps(dict(case=case, **s, error=str(e)[:200])), flush=True)
                continue
            row = dict(case=case, **s, us=sec * 1e6, tbs=kv_bytes / sec / 1e12,
                       of_hbm=kv_bytes / sec / 1e12 / a.hbm_tbs, max_err=err)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        pathlib.Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))

    print("\n| rows×length | impl | kv heads/program | pages/block | warps | stages | splits | "
          "µs/layer | KV TB/s | of HBM | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["case"], r["us"])):
        print(f"| {r['case']} | {r['impl']} | {r.get('kv_per_program', '-')} | "
              f"{r['pages_per_block']} | {r.get('warps', '-')} | "
              f"{r.get('stages', '-')} | {r.get('k_splits', '-')} | {r['us']:.1f} | "
              f"{r['tbs']:.2f} | {r['of_hbm']:.0%} | {r['max_err']:.3f} |")


if __name__ == "__main__":
    main()
