"""Ring attention with one seq shard versus cuDNN dense attention, forward + backward, and a
comm/compute model of the ring for 2..64 shards.

    python experiments/bench/ring_attention.py                  # H200: 32K and 128K, bf16
    python experiments/bench/ring_attention.py --heads 12 --kv-heads 2   # Qwen2.5-1.5B heads
    python experiments/bench/ring_attention.py --smoke          # CPU, tiny shapes: checks it

Defaults: B=1, N=K=32 heads (multi-head, as the cuDNN numbers in GPU_NOTES), H=128, bf16,
causal, one segment per row. The ring runs `lrl.models.ring.ring_attention` on a mesh whose
seq axis has --seq-shards devices (1: the one-shard path, no hops); the dense baseline is
`jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")` (XLA off GPU).
Each path is jitted as forward + backward (`jax.vjp` and its pullback), warmed up, then timed
as the median of --iters runs ending in `block_until_ready`.

FLOPs of causal attention: forward 2 * 2 * B * N * T * T * H / 2, backward 2.5 x forward.

B batch rows · T query positions (T_s: one shard's) · N query heads · K key/value heads ·
H head dim.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

# Measured ppermute bandwidth per device over NVLink (GPU_NOTES, 2x H200): bytes -> bytes/s.
NVLINK_POINTS = ((16 * 2**20, 87e9), (128 * 2**20, 265e9), (512 * 2**20, 349e9))


def causal_flops(B, N, T, H):
    fwd = 2 * 2 * B * N * T * T * H / 2
    return fwd, 2.5 * fwd


def time_fn(fn, args, warmup, iters):
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def fwd_bwd(attn):
    import jax

    def f(q, k, v, do):
        o, pullback = jax.vjp(attn, q, k, v)
        return o, pullback(do)
    return jax.jit(f)


def measure(args, T):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from lrl.mesh import make_mesh
    from lrl.models import flash_cudnn, ring

    B, N, K, H = 1, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    mesh = make_mesh({"seq": args.seq_shards}, devices=jax.devices()[:args.seq_shards])
    qspec, _ = ring.attention_specs(mesh, B, N, K, "seq")
    keys = jax.random.split(jax.random.key(0), 4)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, qspec))
    q = put(jax.random.normal(keys[0], (B, T, N, H), dtype))
    k = put(jax.random.normal(keys[1], (B, T, K, H), dtype))
    v = put(jax.random.normal(keys[2], (B, T, K, H), dtype))
    do = put(jax.random.normal(keys[3], (B, T, N, H), dtype))
    on_gpu = jax.default_backend() == "gpu"

    ring_fn = fwd_bwd(lambda q, k, v: ring.ring_attention(
        q, k, v, None, mesh=mesh, layout=args.layout, implementation=args.impl,
        q_chunk=args.chunk, kv_chunk=args.chunk))
    dense_impl = "cudnn" if on_gpu else None
    dense_fn = fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=dense_impl))
    why = flash_cudnn.unavailable_reason(q, k, need_bwd=True)
    ring_kernel = args.impl or ("cudnn" if why is None else f"xla ({why})")
    fwd, bwd = causal_flops(B, N, T, H)
    rows = []
    for name, fn, kernel, shards in (("ring", ring_fn, ring_kernel, args.seq_shards),
                                     ("dense", dense_fn, dense_impl or "xla", 1)):
        if name == "dense" and args.seq_shards > 1:
            continue  # dense on one device; compare one-shard ring with it
        compiled = fn.lower(q, k, v, do).compile()
        temp = compiled.memory_analysis()
        seconds = time_fn(compiled, (q, k, v, do), args.warmup, args.iters)
        rows.append(dict(T=T, path=name, kernel=kernel, shards=shards, ms=seconds * 1e3,
                         tflops=(fwd + bwd) / seconds / 1e12 / shards,
                         temp_gib=(temp.temp_size_in_bytes / 2**30) if temp else float("nan")))
    dense = [r for r in rows if r["path"] == "dense"]
    for r in rows:
        r["vs_dense"] = dense[0]["ms"] / r["ms"] if dense else float("nan")
    return rows


def nvlink_bandwidth(nbytes):
    """Log-linear interpolation of the measured ppermute points, clamped at both ends."""
    sizes = np.log([p[0] for p in NVLINK_POINTS])
    return float(np.interp(np.log(nbytes), sizes, [p[1] for p in NVLINK_POINTS]))


def comm_model(args):
    """Per hop of the zigzag ring: K+V of one shard travel while half a T_s x T_s block of
    attention is computed (the diagonal hop does the same half through the causal mask)."""
    N, K, H, B = args.heads, args.kv_heads, args.head_dim, 1
    rate = args.achieved_tflops * 1e12
    ib = args.ib_gbytes * 1e9
    # fwd: bytes 2*B*T_s*K*H*2 (bf16) vs flops 2*B*N*T_s^2*H -> compute >= comm when
    # T_s >= 2*K*rate/(N*bw). bwd: K,V bf16 + dK,dV fp32 (3x the bytes), 2.5x the flops.
    lines = [
        f"## Ring comm/compute model (N={N}, K={K}, H={H}, B=1, bf16; compute at "
        f"{args.achieved_tflops:.0f} TFLOP/s achieved of 791 peak)",
        "",
        "Per hop: forward sends K+V = 4*T_s*K*H bytes and computes 2*N*T_s^2*H FLOPs (half a "
        "block); backward sends K,V (bf16) + dK,dV (fp32) = 12*T_s*K*H bytes and computes "
        "2.5x the forward FLOPs. Compute-bound when T_s >= 2*K*rate/(N*bw) (forward) and "
        "T_s >= 2.4*K*rate/(N*bw) (backward), with rate the achieved FLOP rate.",
        "",
    ]
    for label, bw in (("NVLink 350 GB/s", 350e9), (f"InfiniBand {args.ib_gbytes:.0f} GB/s", ib)):
        t_fwd, t_bwd = 2 * K * rate / (N * bw), 2.4 * K * rate / (N * bw)
        lines.append(f"- {label}: compute-bound from T_s >= {t_fwd:,.0f} tokens per shard "
                     f"(forward), {t_bwd:,.0f} (backward).")
    lines += ["", "The table uses, for NVLink, the measured ppermute bandwidth at each hop's size "
              "(GPU_NOTES: 87 / 265 / 349 GB/s at 16 / 128 / 512 MiB, log-interpolated; below "
              "16 MiB it stays at 87 GB/s, which flatters small, latency-bound hops).", ""]
    lines.append("| total T | shards | T_s | K+V per hop | fwd compute ms | fwd NVLink ms | "
                 "fwd IB ms | fwd NVLink | fwd IB | bwd NVLink | bwd IB |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for total in args.model_lengths:
        for n in (2, 4, 8, 16, 32, 64):
            Ts = total / n
            nbytes = 2 * B * Ts * K * H * 2
            flops = 2 * B * N * Ts * Ts * H
            t_c = flops / rate
            t_nv = nbytes / nvlink_bandwidth(nbytes)
            t_ib = nbytes / ib
            # backward: 3x the bytes (dK, dV in fp32 join K, V) over 2.5x the compute
            t_nv_b = 3 * nbytes / nvlink_bandwidth(3 * nbytes)
            bound = lambda t_comm, t_comp: "compute" if t_comp >= t_comm else "comm"
            lines.append(f"| {total:,} | {n} | {Ts:,.0f} | {nbytes / 2**20:,.1f} MiB | "
                         f"{t_c * 1e3:.3f} | {t_nv * 1e3:.3f} | {t_ib * 1e3:.3f} | "
                         f"{bound(t_nv, t_c)} | {bound(t_ib, t_c)} | "
                         f"{bound(t_nv_b, 2.5 * t_c)} | {bound(3 * t_ib, 2.5 * t_c)} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq-shards", type=int, default=1)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--impl", default=None, choices=(None, "xla", "cudnn"))
    p.add_argument("--chunk", type=int, default=512, help="XLA kernel tile")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--achieved-tflops", type=float, default=560.0)
    p.add_argument("--ib-gbytes", type=float, default=50.0, help="400 Gb/s per GPU")
    p.add_argument("--model-lengths", default="131072,1048576")
    args = p.parse_args()
    if args.smoke:
        args.lengths, args.heads, args.kv_heads, args.head_dim = "256,512", 4, 2, 32
        args.chunk, args.warmup, args.iters = 128, 1, 2
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.model_lengths = [int(x) for x in args.model_lengths.split(",")]

    import jax
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x{len(jax.devices())}, "
          f"B=1 N={args.heads} K={args.kv_heads} H={args.head_dim} {args.dtype}, "
          f"layout {args.layout}, seq shards {args.seq_shards}\n")
    print("| T | path | kernel | shards | fwd+bwd ms | TFLOP/s per device | dense/path time "
          "| temp GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        for r in measure(args, T):
            print(f"| {r['T']:,} | {r['path']} | {r['kernel']} | {r['shards']} | {r['ms']:.2f} | "
                  f"{r['tflops']:.4g} | {r['vs_dense']:.3f} | {r['temp_gib']:.3f} |", flush=True)
    print()
    print(comm_model(args))


if __name__ == "__main__":
    main()
