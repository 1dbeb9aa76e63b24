"""Policy-update throughput on one accelerator, side by side with the PyTorch peer.

Qwen2.5-1.5B shapes, random weights, fp32 master params with bf16 compute, one packed row of
T tokens, one GRPO `update_step` (forward, chunked log-probs, clipped loss, backward, AdamW).
Each (T, remat) runs in its own subprocess so peak memory and compile time are its own.

    python experiments/bench/train_step.py --lengths 4096,16384,32768 \
        --peer .dev/peer/peer_torch.py           # on the H200, prints a markdown table
    python experiments/bench/train_step.py --smoke   # CPU, tiny shapes, checks the script

FLOPs per token follow the peer's count so the ratio is like for like:
6 * params + 6 * layers * T * width (causal attention), against --peak-tflops (791, the
measured bf16 matmul rate of the H200). (BENCHMARKS.md's tables call the row length L.)

T query positions: the tokens of the row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def qwen25_15b(**kw):
    from lrl.models import ModelConfig
    return ModelConfig(model_type="qwen2", vocab_size=151936, d_model=1536, n_layers=28,
                       n_heads=12, n_kv_heads=2, head_dim=128, mlp_dim=8960, rope_theta=1e6,
                       qkv_bias=True, tie_embeddings=True, **kw)


def tiny(**kw):
    from lrl.models import ModelConfig
    return ModelConfig(model_type="qwen2", vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                       tie_embeddings=True, **kw)


def one(T: int, remat: str, smoke: bool, repeats: int, attention: str, chunk: int,
        packed: bool, seq: int = 1, fused_head: bool = True,
        param_shard_axes: tuple = ("fsdp",), scan_layers: bool = True,
        uninit_scan=None) -> dict:
    import jax
    import jax.numpy as jnp
    from lrl import mesh as mesh_lib

    dtype = jnp.float32 if smoke else jnp.bfloat16
    make = tiny if smoke else qwen25_15b
    cfg = make(dtype=dtype, param_dtype=jnp.float32, remat=remat, attention=attention,
               param_shard_axes=param_shard_axes, scan_layers=scan_layers)
    # seq > 1: the row's tokens split over `seq` devices (ring or ulysses attention)
    mesh = mesh_lib.make_mesh({"seq": seq} if seq > 1 else {"fsdp": -1},
                              devices=jax.devices()[:seq])
    return {"lrl": True, "seq": T, "remat": remat, "attention": attention, "packed": packed,
            "devices": seq, "fused_head": fused_head, "scan_layers": scan_layers,
            **measure(cfg, mesh, T, repeats, chunk, packed, fused_head, uninit_scan)}


def measure(cfg, mesh, T: int, repeats: int, chunk: int, packed: bool,
            fused_head: bool = True, uninit_scan=None) -> dict:
    """One row of T tokens through `update_step` for `cfg` on `mesh` (AdamW, as the loop's
    default optimizer): seconds a step after the first, TFLOP/s a device by the peer's count,
    compile time, peak memory. grpo_step.py calls it for the update bench's rate at its run's
    row length."""
    import jax
    import numpy as np
    from lrl import mesh as mesh_lib
    from lrl.models.scan_buffers import UninitialisedScanJit
    from lrl.rl import losses, optim, update

    tx = optim.make_optimizer(lr=1e-6, warmup_steps=1, total_steps=100)
    state = update.make_init_fn(cfg, tx, mesh)(jax.random.key(0))
    fn = update.make_update_fn(cfg, losses.LossConfig(), tx, mesh, chunk=chunk, packed=packed,
                               fused_head=fused_head, uninit_scan=uninit_scan)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (1, T), dtype=np.int32)
    batch = {"tokens": tokens, "positions": np.arange(T, dtype=np.int32)[None],
             "segment_ids": np.ones((1, T), np.int32),
             "targets": np.roll(tokens, -1, axis=1), "loss_mask": np.ones((1, T), np.float32),
             "advantages": rng.standard_normal((1, T)).astype(np.float32)}
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh, 2))
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is not None:  # what XLA plans to hold, before any step runs
        print("MEMORY " + json.dumps({"seq": T, "remat": cfg.remat, "compile_s": compile_s, **{
            k: getattr(mem, k) / 2**30 for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                 "output_size_in_bytes", "alias_size_in_bytes")
            if hasattr(mem, k)}}), flush=True)
    if repeats > 1:  # the first call pays for allocation; time the ones after it
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        repeats -= 1
    t0 = time.perf_counter()
    for _ in range(repeats):
        state, m = compiled(state, batch)
    jax.block_until_ready((state, m))
    dt = (time.perf_counter() - t0) / repeats
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    flops = (6 * n_params + 6 * cfg.n_layers * T * cfg.d_model) * T
    stats = jax.devices()[0].memory_stats() or {}
    n_dev = mesh.devices.size
    return {"uninit_scan": isinstance(fn, UninitialisedScanJit), "step_s": dt,
            "tokens_per_s": T / dt, "tflops": flops / dt / 1e12 / n_dev,
            "compile_s": compile_s, "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--remat", default="dots_attn,save_attn,full",
                    help="comma-separated policies to try per length; the best is reported")
    ap.add_argument("--attention", default="dense")
    ap.add_argument("--chunk", type=int, default=2048, help="log-prob chunk (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=791.0)
    ap.add_argument("--peer", default="", help="path to peer_torch.py: run it in this command")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--packed", action="store_true",
                    help="attend through the packed-row (segment ids) path, as RL batches do")
    ap.add_argument("--seq", type=int, default=1,
                    help="devices the row is split over (with --attention ring or ulysses)")
    ap.add_argument("--param-shard-axes", default="fsdp",
                    help='"fsdp,seq": with --seq N the N devices shard the parameters too')
    ap.add_argument("--fused-head", action=argparse.BooleanOptionalAction, default=True,
                    help="the loss's gradient formed in the lm head's forward (lrl.rl.fused_head)")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-scan-layers: one block per layer (no stacked residuals)")
    ap.add_argument("--uninit-scan", action=argparse.BooleanOptionalAction, default=None,
                    help="lower the step with uninitialised stacked scan outputs "
                         "(lrl.models.scan_buffers; default: make_update_fn's, one device only)")
    ap.add_argument("--child", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--budget-s", type=float, default=0, help="skip what would start later")
    a = ap.parse_args()
    if a.child:
        T, remat = a.child.split(":")
        try:
            rec = one(int(T), remat, a.smoke, a.repeats, a.attention, a.chunk, a.packed, a.seq,
                      a.fused_head, tuple(x for x in a.param_shard_axes.split(",") if x),
                      a.scan_layers, a.uninit_scan)
        except Exception as e:  # out of memory, mostly: record it and go on
            rec = {"lrl": True, "seq": int(T), "remat": remat, "error": f"{type(e).__name__}: "
                   f"{str(e).splitlines()[0][:200]}"}
        print("RESULT " + json.dumps(rec), flush=True)
        return
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.smoke:
        lengths = [64, 128]
    results = []
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    t_start = time.time()
    for T in lengths:
        for remat in a.remat.split(","):
            if a.budget_s and time.time() - t_start > a.budget_s:
                results.append({"seq": T, "remat": remat, "error": "skipped (time budget)"})
                continue
            cmd = [sys.executable, __file__, "--child", f"{T}:{remat}", "--repeats",
                   str(a.repeats), "--attention", a.attention, "--chunk", str(a.chunk),
                   "--seq", str(a.seq)]
            cmd += ["--packed"] if a.packed else []
            cmd += ["--fused-head" if a.fused_head else "--no-fused-head"]
            cmd += ["--scan-layers" if a.scan_layers else "--no-scan-layers"]
            if a.uninit_scan is not None:
                cmd += ["--uninit-scan" if a.uninit_scan else "--no-uninit-scan"]
            cmd += ["--param-shard-axes", a.param_shard_axes]
            cmd += ["--smoke"] if a.smoke else []
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            recs = [json.loads(l[7:]) for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            rec = recs[0] if recs else {"seq": T, "remat": remat,
                                        "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
            print(json.dumps(rec), flush=True)
            results.append(rec)
    peer = {}
    if a.peer:
        out = subprocess.run([sys.executable, a.peer, "--train", ",".join(map(str, lengths)),
                              "--generate", ""], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                print(line, flush=True)
                peer[rec["seq"]] = rec
        if not peer:
            print("peer failed:", out.stderr[-2000:])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"lrl": results, "peer": list(peer.values())}, f, indent=1)
    print("\n| T | remat | lrl tok/s | MFU | peak GiB | compile s | peer tok/s | peer MFU | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rec in results:
        p = peer.get(rec["seq"], {})
        if "error" in rec:
            print(f"| {rec['seq']} | {rec['remat']} | {rec['error']} | | | | "
                  f"{p.get('tokens_per_s', p.get('error', ''))} | | |")
            continue
        mfu = rec["tflops"] / a.peak_tflops
        ratio = rec["tokens_per_s"] / p["tokens_per_s"] if p.get("tokens_per_s") else None
        print(f"| {rec['seq']} | {rec['remat']} | {rec['tokens_per_s']:.0f} | {mfu:.1%} | "
              f"{rec['peak_gib']:.1f} | {rec['compile_s']:.1f} | "
              f"{p.get('tokens_per_s', p.get('error', '-')) if p else '-'} | "
              f"{p.get('mfu', 0):.1%} | {f'{ratio:.2f}x' if ratio else '-'} |")


if __name__ == "__main__":
    main()
