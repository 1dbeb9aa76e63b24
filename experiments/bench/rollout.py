"""Rollout throughput of `lrl.rollout.generate` against the HBM roofline and the PyTorch peer.

On one H200 (Qwen2.5-1.5B shapes, random bf16 weights, temperature-1 sampling, no end token so
every sample runs to its length limit, like the peer's min_new_tokens):
    python experiments/bench/rollout.py --peer ../shared/bench/peer_torch.py
On CPU, a tiny model and tiny cases, to check the script itself:
    python experiments/bench/rollout.py --smoke

Cases are PxTxn (P prompts of T tokens, n new tokens each, one sample per prompt). Each runs
once to compile (the same prompts: full-width and narrow calls) and once timed. Reported per case:
new tok/s end to end (prefill + decode + host work) and decode only, ms per decode step, the
roofline step time (weight bytes + the mean live KV bytes of a step, over --hbm-tbs) and the
fraction of it reached. The shared case PxGxTxn samples G completions per prompt and compares
the shared prefill (each prompt once, its full pages shared by its G samples) with prefilling
every sample: pages computed, prefill time measured on --unshared-prompts prompts repeated G
times and scaled to P. The peer (--peer path) runs first, in a subprocess, before jax takes
the GPU's memory.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere


def model_config(smoke: bool):
    import jax.numpy as jnp
    from lrl.models.config import ModelConfig
    if smoke:
        return ModelConfig(model_type="qwen2", vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                           tie_embeddings=True, remat="none")
    return ModelConfig(model_type="qwen2", vocab_size=151936, d_model=1536, n_layers=28,
                       n_heads=12, n_kv_heads=2, head_dim=128, mlp_dim=8960, rms_norm_eps=1e-6,
                       rope_theta=1e6, qkv_bias=True, tie_embeddings=True, dtype=jnp.bfloat16,
                       param_dtype=jnp.bfloat16, remat="none")


def weight_bytes_per_step(cfg, params) -> int:
    """Bytes a decode step must read: every weight once; the embedding table only through the
    unembedding when tied (the lookup itself reads a few rows)."""
    import jax
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    emb = params["embed"]["embedding"]
    return total if cfg.tie_embeddings else total - emb.size * emb.dtype.itemsize


def run_peer(path: str, specs: list[str]) -> dict:
    cmd = [sys.executable, path, "--train", "", "--generate", ",".join(specs)]
    print("peer:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = {}
    for line in proc.stdout.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("what") == "generate":
            out[f"{rec['batch']}x{rec['prompt']}x{rec['new']}"] = rec
    if proc.returncode:
        print(f"peer exited {proc.returncode}: {proc.stderr[-2000:]}", flush=True)
    return out


def kernel_kwargs(a) -> dict:
    """The decode attention settings given on the command line; the rest stay generate's."""
    given = dict(attention_impl=a.attention, decode_block_pages=a.decode_block_pages,
                 fused_decode=True if a.fused_decode else None,
                 pallas_k_splits=a.k_splits, pallas_warps=a.pallas_warps,
                 pallas_stages=a.pallas_stages, pallas_kv_per_program=a.kv_per_program,
                 sampling_impl=a.sampling)
    return {k: v for k, v in given.items() if v is not None}


def timed_generate(cfg, params, prompts, G, n_new, common, stats):
    from lrl import rollout
    t0 = time.perf_counter()
    rollout.generate(cfg, params, prompts, max_new_tokens=n_new, num_samples=G, stats=stats,
                     **common)
    return time.perf_counter() - t0


def bench_case(cfg, params, spec, a, wbytes):
    from lrl.rollout.pages import kv_bytes_per_token
    P, T, n_new = (int(x) for x in spec.split("x"))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, size=T) for _ in range(P)]
    common = dict(temperature=1.0, seed=0, page_size=a.page_size, max_slots=P,
                  pool_tokens=P * (T + n_new + 2 * a.page_size), prefill_chunk=a.prefill_chunk,
                  steps_per_call=a.steps_per_call, layer_unroll=a.layer_unroll,
                  **kernel_kwargs(a))
    if a.prefill_params == "train":   # the training layout, as generate read it before
        common["prefill_fn"] = lambda engine, p, state, pre: engine.run_prefill(p, state, pre)
    warm = {}
    # Every prompt: the warm-up compiles the full-width prefill and decode calls and the
    # narrow ones of the tail (a warm-up of 64 prompts of 256 ran only the narrow decode, and
    # the timed run compiled the full width: 45 ms a step at 256 x 300).
    t_compile = timed_generate(cfg, params, prompts, 1, n_new, common, warm)
    stats = {}
    total = timed_generate(cfg, params, prompts, 1, n_new, common, stats)
    steps = stats["decode_steps"]
    step_s = stats["decode_s"] / steps
    kv_bytes = stats["kv_token_steps"] / steps * kv_bytes_per_token(cfg)
    roof_s = (wbytes + kv_bytes) / (a.hbm_tbs * 1e12)
    new = stats["new_tokens"]
    return dict(case=spec, prompts=P, prompt_len=T, new=n_new, total_s=total,
                prefill_s=stats["prefill_s"], decode_s=stats["decode_s"], decode_steps=steps,
                new_tok_s=new / total, decode_tok_s=new / stats["decode_s"],
                step_ms=step_s * 1e3, roofline_ms=roof_s * 1e3, roofline_frac=roof_s / step_s,
                weight_gb=wbytes / 1e9, live_kv_gb=kv_bytes / 1e9, first_run_s=t_compile,
                attention=stats["attention_impl"], sampling=stats["sampling_impl"],
                fallback=stats["attention_fallback"])


def bench_shared(cfg, params, spec, a):
    P, G, T, n_new = (int(x) for x in spec.split("x"))
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, cfg.vocab_size, size=T) for _ in range(P)]
    common = dict(temperature=1.0, seed=0, page_size=a.page_size, max_slots=P * G,
                  pool_tokens=P * T + P * G * (n_new + 2 * a.page_size),
                  prefill_chunk=a.prefill_chunk, steps_per_call=a.steps_per_call,
                  layer_unroll=a.layer_unroll, **kernel_kwargs(a))
    timed_generate(cfg, params, prompts[:1], G, n_new, common, {})        # compile
    stats = {}
    total = timed_generate(cfg, params, prompts, G, n_new, common, stats)
    k = min(a.unshared_prompts, P)
    unshared = {}
    # Same slots, pool and lengths as the shared run, so the same compiled shapes.
    timed_generate(cfg, params, [p for p in prompts[:k] for _ in range(G)], 1, n_new, common,
                   unshared)
    unshared_prefill_s = unshared["prefill_s"] * P / k
    return dict(case=spec, prompts=P, group=G, prompt_len=T, new=n_new, total_s=total,
                prefill_shared_s=stats["prefill_s"], prefill_unshared_s=unshared_prefill_s,
                prefill_saving=unshared_prefill_s / stats["prefill_s"],
                pages_shared=stats["pages_allocated"], pages_unshared=stats["pages_unshared"],
                page_saving=stats["pages_unshared"] / stats["pages_allocated"],
                peak_pages=stats["peak_pages"], decode_s=stats["decode_s"],
                new_tok_s=stats["new_tokens"] / total, unshared_measured_prompts=k)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and cases, for CPU")
    ap.add_argument("--cases", default=None, help="PxTxn,... (default 64x512x256,256x512x256,"
                                                  "16x8192x256)")
    ap.add_argument("--shared", default=None, help="PxGxTxn for the shared-prefill comparison "
                                                   "(default 16x8x32768x32; '' skips it)")
    ap.add_argument("--unshared-prompts", type=int, default=2,
                    help="prompts whose G copies are prefilled one by one to time the unshared "
                         "prefill")
    ap.add_argument("--peer", default=None, help="path to peer_torch.py (runs it first)")
    ap.add_argument("--hbm-tbs", type=float, default=4.1, help="measured HBM TB/s")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--steps-per-call", type=int, default=None)
    ap.add_argument("--layer-unroll", type=int, default=1, help="unroll of the layer scan")
    ap.add_argument("--decode-block-pages", type=int, default=None,
                    help="pages per compute block of the decode attention kernel (default: "
                         "generate's)")
    ap.add_argument("--k-splits", type=int, default=None,
                    help="kv splits of the Pallas decode kernel (default: from the slots)")
    ap.add_argument("--pallas-warps", type=int, default=None,
                    help="Triton num_warps (default: generate's)")
    ap.add_argument("--pallas-stages", type=int, default=None,
                    help="Triton num_stages (default: generate's)")
    ap.add_argument("--kv-per-program", type=int, default=None,
                    help="pallas_gqa: kv heads per program (0: fill one q tile)")
    ap.add_argument("--prefill-params", choices=("decode", "train"), default="decode",
                    help="layout of the weights prefill reads (generate's: decode)")
    ap.add_argument("--fused-decode", action="store_true",
                    help="the decode kernel also rotates q/k and writes the pages")
    ap.add_argument("--attention", default=None,
                    help="decode attention: pallas_gqa | pallas | xla (default: generate's)")
    ap.add_argument("--sampling", default=None,
                    help="the sampler's pass over the logits: pallas | xla (default: generate's)")
    return ap


def settings(argv: list[str]) -> argparse.Namespace:
    """The bench's settings from a command line (`[]`: its defaults), with the defaults that
    depend on --smoke filled in: what `bench_case` reads (grpo_step.py measures with them)."""
    a = parser().parse_args(argv)
    a.prefill_chunk = a.prefill_chunk or (32 if a.smoke else 4096)
    a.steps_per_call = a.steps_per_call or (4 if a.smoke else 32)
    return a


def main():
    a = settings(sys.argv[1:])
    cases = (a.cases if a.cases is not None else
             "4x16x8,8x16x8,2x64x8" if a.smoke else "64x512x256,256x512x256,16x8192x256")
    cases = [c for c in cases.split(",") if c]
    shared = a.shared if a.shared is not None else "2x4x128x4" if a.smoke else "16x8x32768x32"

    peer = run_peer(a.peer, cases) if a.peer else {}   # before jax claims the GPU

    import jax
    from lrl.models import init_params
    cfg = model_config(a.smoke)
    params = init_params(cfg, jax.random.key(0))
    wbytes = weight_bytes_per_step(cfg, params)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
          f"{jax.__version__}, {cfg.num_params() / 1e9:.3f}B params, {wbytes / 1e9:.2f} GB read "
          f"per decode step", flush=True)

    rows = []
    for spec in cases:
        r = bench_case(cfg, params, spec, a, wbytes)
        if spec in peer and "new_tokens_per_s" in peer[spec]:
            r["peer_tok_s"] = peer[spec]["new_tokens_per_s"]
            r["vs_peer"] = r["new_tok_s"] / r["peer_tok_s"]
        print(json.dumps(r), flush=True)
        rows.append(r)
    if rows:
        print(f"decode attention: {rows[0]['attention']}, sampling: {rows[0]['sampling']}"
              + (f" (Pallas fell back: {rows[0]['fallback']})" if rows[0]["fallback"] else ""))
    shared_row = bench_shared(cfg, params, shared, a) if shared else None
    if shared_row:
        print(json.dumps(shared_row), flush=True)

    print("\n| case PxT→n | new tok/s | decode tok/s | ms/step | roofline ms/step | "
          "of roofline | peer tok/s | × peer |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        peer_s = f"{r['peer_tok_s']:.0f}" if "peer_tok_s" in r else "-"
        ratio = f"{r['vs_peer']:.1f}" if "vs_peer" in r else "-"
        print(f"| {r['prompts']}×{r['prompt_len']}→{r['new']} | {r['new_tok_s']:.0f} | "
              f"{r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {r['roofline_ms']:.2f} | "
              f"{r['roofline_frac']:.0%} | {peer_s} | {ratio} |")
    if shared_row:
        s = shared_row
        print(f"\n| shared prefill {s['prompts']}×G{s['group']}×{s['prompt_len']}→{s['new']} | "
              f"shared | every sample | saving |\n|---|---|---|---|\n"
              f"| prefill s | {s['prefill_shared_s']:.2f} | {s['prefill_unshared_s']:.2f} "
              f"(measured on {s['unshared_measured_prompts']}×G, scaled) | "
              f"{s['prefill_saving']:.1f}× |\n"
              f"| KV pages | {s['pages_shared']} | {s['pages_unshared']} | "
              f"{s['page_saving']:.1f}× |")


if __name__ == "__main__":
    main()
