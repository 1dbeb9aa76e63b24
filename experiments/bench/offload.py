"""Optimizer host offload (lrl/rl/offload.py, docs/offload.md) on one accelerator: the policy
update's step with bf16 masters on the device, fp32 masters and Adam moments on the device
(where they fit: 1.5B), and fp32 masters and moments offloaded to pinned host memory.
Qwen2.5 1.5B and 7B shapes, random weights, bf16 compute, one device.

A step is the loop's host-driven update (`lrl.rl.update.run_update`): M micro-batches of one
packed row of T tokens through `accumulate`, then `apply` (the optimizer step, which is what
offload changes). Each case runs in its own subprocess (its own peak memory and compiles) and
reports: the whole step and the apply alone (s, the mean of the steps after the first), tokens
a second, MFU (6 * params + 6 * layers * T * width FLOPs a token, as train_step.py, against
--peak-tflops 791, the H200's measured bf16 matmul rate), the first step (compiles included),
peak device memory, the apply program's device and host bytes (XLA's memory analysis), the
host link's rate (the apply's host bytes, in and back out, over its time: at one direction's
rate the copies ran one after the other), the share of one weight block that moved over the
steps at lr 1e-6 (bf16 masters: most updates round away; fp32: they move; nan where the
weights went NaN), and the last loss.
With bf16 masters and AdamW's b2=0.999 (configs/qwen2_5_math.py's) optax casts the injected
b2 to bf16, where it is 1.0: the bias correction divides by zero and every update is NaN (on
CPU as measured; the step time is still the step's).

    python experiments/bench/offload.py --out /tmp/offload.json   # H200: 5 cases, <= 400 s
    python experiments/bench/offload.py --smoke                   # CPU, tiny shapes

On CPU the offloaded case is forced (`optim.offload="auto"` never offloads there) and the
"host" is the same RAM: the smoke run checks the script, not the saving.
T positions in a row · M micro-batches.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CASES = "7b:offload,7b:bf16,1.5b:fp32,1.5b:offload,1.5b:bf16"
SHAPES = {
    "1.5b": dict(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                 head_dim=128, mlp_dim=8960, tie_embeddings=True, remat="dots_attn"),
    "7b": dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
               head_dim=128, mlp_dim=18944, remat="save_attn"),   # as configs/qwen2_5_math.py
    "tiny": dict(vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                 head_dim=16, mlp_dim=128, tie_embeddings=True, remat="full"),
}


def _model(size: str, mode: str):
    import jax.numpy as jnp
    mode = mode.partition("+")[0]
    from lrl.models import ModelConfig
    return ModelConfig(model_type="qwen2", rope_theta=1e6, qkv_bias=True, dtype=jnp.bfloat16,
                       param_dtype=jnp.bfloat16 if mode == "bf16" else jnp.float32,
                       **SHAPES[size])


def _optimizer(cfg, mode: str):
    from lrl.rl import offload, optim
    mode = mode.partition("+")[0]
    kw = dict(lr=1e-6, warmup_steps=1, total_steps=100)   # qwen2_5_math's lr
    if mode != "offload":
        return optim.make_optimizer(**kw, clip_norm=1.0)
    return offload.Offload(optim.make_optimizer(**kw, clip_norm=None), 1.0,
                           compute_dtype=cfg.dtype, master_dtype=cfg.param_dtype,
                           split_rest=True)   # one device, as the loop's choice there


def _micro_batches(cfg, T: int, M: int):
    import numpy as np
    rng = np.random.default_rng(0)
    out = []
    for _ in range(M):
        tokens = rng.integers(0, cfg.vocab_size, (1, T), dtype=np.int32)
        out.append({"tokens": tokens, "positions": np.arange(T, dtype=np.int32)[None],
                    "segment_ids": np.ones((1, T), np.int32),
                    "targets": np.roll(tokens, -1, axis=1),
                    "loss_mask": np.ones((1, T), np.float32),
                    "advantages": rng.standard_normal((1, T)).astype(np.float32)})
    return out


def _probe(state):
    """A block of one layer's weights as the step sees them (the masters)."""
    import jax
    import numpy as np
    from lrl.rl import train
    w = train.masters(state)["layers"]["up_proj"]["kernel"]
    return np.asarray(jax.device_get(w[0, :256, :256]), np.float32)


def child(size: str, mode: str, T: int, M: int, repeats: int) -> dict:
    import jax
    import numpy as np
    from lrl import mesh as mesh_lib
    from lrl import models
    from lrl.rl import losses, train, update

    cfg = _model(size, mode)
    mesh = mesh_lib.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    tx = _optimizer(cfg, mode)
    sh = train.train_state_shardings(cfg, tx, mesh)
    state = train.place_train_state(models.init_params(cfg, jax.random.key(0), mesh), tx, sh)
    before = _probe(state)
    u = update.make_update_programs(cfg, losses.LossConfig(), tx, mesh, chunk=2048,
                                    grad_sink=mode.endswith("+sink"))
    host = _micro_batches(cfg, T, M)
    denoms = update.host_denominators(host)
    mbs = [mesh_lib.put_batch(mesh, mb) for mb in host]
    p = u.programs

    def step(state):
        t0 = time.perf_counter()
        acc = p.start(state.params, mbs[0], denoms, None)
        for mb in mbs:
            acc = p.accumulate(state.params, acc, mb, denoms, None)
        jax.block_until_ready(acc)
        t1 = time.perf_counter()
        state, m = p.apply(state, acc)
        jax.block_until_ready((state, m))
        return state, m, time.perf_counter() - t0, time.perf_counter() - t1

    state, m, first_s, _ = step(state)   # compiles
    times = []
    for _ in range(repeats):
        state, m, step_s, apply_s = step(state)
        times.append((step_s, apply_s))
    acc = p.start(state.params, mbs[0], denoms, None)
    mem = p.apply.lower(state, acc).compile().memory_analysis()
    after = _probe(state)
    moved = float((after != before).mean()) if np.isfinite(after).all() else float("nan")
    step_s = sum(t for t, _ in times) / len(times)
    apply_s = sum(a for _, a in times) / len(times)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    flops = (6 * n_params + 6 * cfg.n_layers * T * cfg.d_model) * T * M
    stats = jax.devices()[0].memory_stats() or {}
    gib = lambda n: n / 2**30  # noqa: E731
    return {"size": size, "mode": mode, "T": T, "M": M, "params": n_params,
            "step_s": step_s, "apply_s": apply_s, "first_step_s": first_s,
            "tokens_per_s": T * M / step_s, "tflops": flops / step_s / 1e12,
            "peak_gib": gib(stats.get("peak_bytes_in_use", 0)),
            "apply_device_gib": gib(mem.argument_size_in_bytes + mem.temp_size_in_bytes),
            "apply_host_gib": gib(getattr(mem, "host_argument_size_in_bytes", 0)),
            "moved": moved, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "learning_rate": float(m["learning_rate"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES, help="size:mode, mode bf16 | fp32 | offload, "
                    "+sink after it: the layers' gradients added into the accumulator in the "
                    "backward (lrl.models.grad_sink)")
    ap.add_argument("--T", type=int, default=8192, help="tokens in a row")
    ap.add_argument("--M", type=int, default=2, help="micro-batches (rows) a step")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps after the first")
    ap.add_argument("--peak-tflops", type=float, default=791.0)
    ap.add_argument("--budget-s", type=float, default=300, help="start no case after this")
    ap.add_argument("--limit-s", type=float, default=400,
                    help="the whole run's limit: a case still running then is stopped")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.child:
        size, mode = a.child.split(":")
        try:
            rec = child(size, mode, a.T, a.M, a.repeats)
        except Exception as e:   # out of memory, mostly: record it and go on
            rec = {"size": size, "mode": mode,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"}
        print("RESULT " + json.dumps(rec), flush=True)
        return
    cases = a.cases.split(",")
    if a.smoke:
        cases, a.T, a.M, a.repeats = (["tiny:bf16", "tiny:fp32", "tiny:offload",
                                       "tiny:offload+sink"], 64, 2, 2)
    from lrl import xla_env
    env = dict(os.environ)
    xla_env.set_defaults(env)   # as `python -m lrl.main`: 7B's masters and moments are ~91 GB
    t_start, results = time.time(), []
    for case in cases:
        left = a.budget_s - (time.time() - t_start)
        if left <= 0:
            results.append({"size": case.split(":")[0], "mode": case.split(":")[1],
                            "error": "skipped (time budget)"})
            continue
        cmd = [sys.executable, __file__, "--child", case, "--T", str(a.T), "--M", str(a.M),
               "--repeats", str(a.repeats)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                 timeout=max(1.0, a.limit_s - (time.time() - t_start)))
            recs = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            rec = recs[0] if recs else {
                "size": case.split(":")[0], "mode": case.split(":")[1],
                "error": (out.stderr.strip().splitlines() or ["?"])[-1][:240]}
        except subprocess.TimeoutExpired:
            rec = {"size": case.split(":")[0], "mode": case.split(":")[1], "error": "timed out"}
        print(json.dumps(rec), flush=True)
        results.append(rec)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\nT={a.T} tokens a row, M={a.M} rows a step, lr 1e-6, total {time.time() - t_start:.0f} s")
    print("| model | masters | step s | apply s | tok/s | MFU | first step s | peak GiB | "
          "apply device / host GiB | host link GB/s | weights moved | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    names = {"bf16": "bf16, device", "fp32": "fp32, device", "offload": "fp32, host (offload)"}
    for r in results:
        base, _, sink = r["mode"].partition("+")
        name = names[base] + (", layer gradients into the accumulator" if sink else "")
        if "error" in r:
            print(f"| {r['size']} | {name} | {r['error']} | | | | | | | | | |")
            continue
        # The apply copies the host bytes in and back out: their sum over its time, against
        # the link's rate each way (PCIe Gen5 x16: 64 GB/s nominal) says whether the two
        # directions overlapped.
        link = (f"{2 * r['apply_host_gib'] * 2**30 / r['apply_s'] / 1e9:.0f}"
                if r["apply_host_gib"] else "-")
        print(f"| {r['size']} | {name} | {r['step_s']:.3f} | {r['apply_s']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['tflops'] / a.peak_tflops:.1%} | "
              f"{r['first_step_s']:.1f} | {r['peak_gib']:.1f} | {r['apply_device_gib']:.1f} / "
              f"{r['apply_host_gib']:.1f} | {link} | {r['moved']:.1%} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
