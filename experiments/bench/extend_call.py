"""One multi-turn observation call alone: `prefill_chunk` [R, C] over histories of S tokens, by
the pages a block of its paged read holds (`EngineConfig.extend_block_pages`).

The multi-turn bench (multiturn.py) spends ~2.5 s of a ~9 s rollout in these calls at 18-20%
of the matmul rate (BENCHMARKS.md, "Multi-turn rollouts"). A call writes R rows of C tokens
(48 valid: the bench's observation) after S cached ones and reads the S through the pages in
a device loop over blocks; a bigger block computes and masks scores for keys the rows do not
have, a smaller one takes more loop trips a layer. `first=True` (no paged read: the chunk
attends to itself only) is the floor. Then run multiturn.py with --extend-block-pages at the
fastest block to see what the whole rollout gains.

On one GPU (Qwen2.5-1.5B shapes, random bf16 weights):
    python experiments/bench/extend_call.py
On CPU, the multi-turn bench's tiny model, to check the script itself:
    python experiments/bench/extend_call.py --smoke
R rows · C tokens a row · S cached tokens before them.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the tiny model (CPU)")
    ap.add_argument("--rows", default="16", help="R of the calls, comma-separated")
    ap.add_argument("--blocks", default="64,32,16,8", help="pages a block, comma-separated")
    ap.add_argument("--histories", default="512,1000", help="S, comma-separated")
    ap.add_argument("--obs", type=int, default=48, help="valid tokens a row")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (10; smoke 3)")
    a = ap.parse_args()
    import jax
    import multiturn
    from lrl.models import init_params
    from lrl.rollout import steps
    bench = multiturn.settings(["--smoke"] * a.smoke + ["--n", "512", "--slots", "256",
                                                       "--prompt", "256", "--turn-max", "128",
                                                       "--obs", str(a.obs), "--turns", "6"])
    cfg = multiturn.model_config(a.smoke)
    engine, *_ = multiturn.build(bench, cfg)
    params = engine.decode_params(init_params(cfg, jax.random.key(0)))
    state = engine.take_state()
    kp, vp = state.k_pages, state.v_pages
    base, page = engine.ecfg, engine.ecfg.page_size
    C = engine.extend_chunk(a.obs + 1)
    reps = a.repeats or (3 if a.smoke else 10)
    rng = np.random.RandomState(0)
    flops_token = 2 * cfg.num_params()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"{cfg.num_params() / 1e6:,.1f}M params, C {C}, {a.obs} valid tokens a row, "
          f"{page} tokens a page")
    print("\n| R | paged read | block pages | history S | ms a call | TFLOP/s (2 x params x "
          "valid tokens) |\n|---|---|---|---|---|---|")
    rows = [int(x) for x in a.rows.split(",")]
    cases = [(R, True, 0, 0) for R in rows]
    cases += [(R, False, bp, S) for R in rows for bp in map(int, a.blocks.split(","))
              for S in map(int, a.histories.split(","))]
    for R, first, bp, S in cases:
        ecfg = dataclasses.replace(base, extend_block_pages=bp) if bp else base
        Y, need = ecfg.pages_per_slot, -(-(S + C) // page)
        if need > Y:
            raise SystemExit(f"a history of {S} tokens needs {need} pages a row, the engine "
                             f"holds {Y}")
        # Rows on pages of their own (page 0 is the null page), so the writes do not collide.
        table = np.zeros((R, Y), np.int32)
        for r in range(R):
            table[r, :need] = 1 + r * need + np.arange(need)
        tokens = rng.randint(0, cfg.vocab_size, size=(R, C)).astype(np.int32)
        start, n_valid = np.full(R, S, np.int32), np.full(R, a.obs, np.int32)

        def call(kp, vp):
            return steps.prefill_chunk(cfg, ecfg, params, kp, vp, tokens, start, n_valid,
                                       table, first=first, block_pages=ecfg.extend_block_pages)
        for _ in range(2):                       # compile, then one warm call
            kp, vp = call(kp, vp)
        jax.block_until_ready(kp)
        t0 = time.perf_counter()
        for _ in range(reps):
            kp, vp = call(kp, vp)
        jax.block_until_ready(kp)
        ms = (time.perf_counter() - t0) / reps * 1e3
        print(f"| {R} | {'no (first=True)' if first else 'yes'} | {bp or '-'} | "
              f"{S if not first else 0} | {ms:.2f} | {flops_token * R * a.obs / ms / 1e9:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
