"""Video GRPO step time against frame count: vision encode, rollout prefill and the policy
update of one video prompt, with and without the embedding cache (MR-SP stage 1) and with and
without sequence parallelism (MR-SP stage 2: seq=1 vs seq=n over all n devices).

Qwen2.5-VL-7B shapes with random weights (bf16 compute and storage, SGD so that the 7B update
fits one H200: the step's time, not an optimizer's memory, is measured here). A prompt is one
video of `frames` frames at --tokens-per-frame merged tokens per temporal patch (2 frames),
so frames/2 x tokens-per-frame visual tokens, plus a short question; the update row is that prompt
plus --new-tokens completion tokens.

    python experiments/bench/video_frames.py                       # GPU(s): markdown table
    python experiments/bench/video_frames.py --frames 8,64,512 --tokens-per-frame 128
    python experiments/bench/video_frames.py --small               # CPU smoke (< 1 minute)

Each seq setting runs in a subprocess that builds the model once and then the rows in order
of frame count. A row that runs out of memory prints "OOM" and ends its subprocess; a row
that takes longer than --budget-s (the subprocess's set-up counts towards its first row) is
killed and prints "timeout"; a fresh subprocess then continues with the next row. Inside a
row every stage runs once to compile and once timed. Columns:
- vision s: cache off = the frames through the vision tower (split over the row's devices);
  cache on = a cache hit (key from the video file's path, mtime and size: no tower call).
  Decoding the mp4 is not included (frames are random patches).
- prefill s: seq=1, the engine's own prefill (chunks of 4096 tokens on one device); seq=n,
  `lrl.rollout.sp_prefill` (the training forward with ring attention over n devices).
- update s: one `update_step` on the packed row (dense attention on one device for seq=1,
  ring attention over n devices for seq=n).
- step s: vision + prefill + update (decode is the same for every row and left out).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere


def configs(small: bool):
    """(text ModelConfig, VisionConfig): Qwen2.5-VL-7B's, or tiny ones for --small."""
    import jax.numpy as jnp
    from lrl.models import ModelConfig
    from lrl.models.vision import VisionConfig
    if small:
        text = ModelConfig(model_type="qwen2", vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                           mrope_section=(2, 3, 3), remat="none")
        return text, VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                  out_hidden_size=64, fullatt_block_indexes=(1,))
    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    text = ModelConfig(model_type="qwen2", vocab_size=152064, d_model=3584, n_layers=28,
                       n_heads=28, n_kv_heads=4, head_dim=128, mlp_dim=18944, rope_theta=1e6,
                       qkv_bias=True, mrope_section=(16, 24, 24), remat="full", **bf16)
    vis = VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       window_size=112, out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31),
                       **bf16)
    return text, vis


def merged_grid(tokens_per_frame: int) -> tuple[int, int]:
    """(rows, cols) of merged tokens per temporal patch, as square as the count allows."""
    rows = max(d for d in range(1, int(tokens_per_frame ** 0.5) + 1) if tokens_per_frame % d == 0)
    return rows, tokens_per_frame // rows


def setup(seq: int, args) -> dict:
    """What every row of one seq setting shares: mesh, configs, the train state (its params
    are the rollout's too), the vision tower and the compiled functions."""
    import jax
    import optax
    from lrl import mesh as mesh_lib
    from lrl import models
    from lrl.models import embed_cache, vision, vl
    from lrl.rl import update as update_lib
    from lrl.rl.losses import LossConfig

    text, vcfg = configs(args.small)
    mesh = mesh_lib.make_mesh({"seq": seq}, devices=jax.devices()[:seq])
    text = text.replace(attention="ring" if seq > 1 else "dense")
    c = vl.VLConfig(text, vcfg, image_token_id=text.vocab_size - 4,
                    video_token_id=text.vocab_size - 3,
                    vision_start_token_id=text.vocab_size - 2,
                    vision_end_token_id=text.vocab_size - 1)
    k1, k2 = jax.random.split(jax.random.key(0))
    tx = optax.sgd(1e-6)
    state = jax.jit(lambda k: update_lib.init_train_state(models.init_params(text, k), tx),
                    out_shardings=update_lib.train_state_shardings(text, tx, mesh))(k1)
    vparams = jax.jit(vision.init_vision_params, static_argnums=0,
                      out_shardings=mesh_lib.replicated(mesh))(vcfg, k2)
    return dict(seq=seq, mesh=mesh, text=text, vcfg=vcfg, c=c, state=state, vparams=vparams,
                encoder=embed_cache.make_encoder(vcfg, mesh, frame_chunk=args.frame_chunk),
                update=update_lib.make_update_fn(text, LossConfig(max_len=args.new_tokens), tx,
                                                 mesh, hidden=vl.batch_hidden_states,
                                                 extra_keys=("visual_index",)))


def run_row(ctx: dict, frames: int, args) -> dict:
    """One row: seconds per stage for a prompt of `frames` frames."""
    import jax
    import numpy as np
    from lrl import mesh as mesh_lib
    from lrl.data.video import VisualItem
    from lrl.models import embed_cache, vl
    from lrl.rollout import Engine, EngineConfig, pages_for, sp_prefill

    mesh, text, vcfg, c, seq = ctx["mesh"], ctx["text"], ctx["vcfg"], ctx["c"], ctx["seq"]
    params = ctx["state"].params
    out = {}
    # Stage 1: the tower on the frames (split over the devices), then a cache hit.
    m = vcfg.spatial_merge_size
    rows, cols = merged_grid(args.tokens_per_frame)
    grid = (-(-frames // vcfg.temporal_patch_size), rows * m, cols * m)
    rng = np.random.default_rng(frames)
    patches = rng.standard_normal((grid[0] * grid[1] * grid[2], vcfg.patch_dim), np.float32)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:   # the cache keys on a file
        item = VisualItem(patches, grid, "video", 1.0, f.name)
        jax.block_until_ready(embed_cache.encode_items(vcfg, ctx["vparams"], [item],
                                                       ctx["encoder"]))      # compile
        cache = embed_cache.EmbeddingCache()
        for key in ("vision_cold_s", "vision_hit_s"):
            t0 = time.perf_counter()
            emb = embed_cache.prompt_embeddings(vcfg, ctx["vparams"], [[item]], ctx["encoder"],
                                                cache, "bench", "random")[0]
            jax.block_until_ready(emb)
            out[key] = time.perf_counter() - t0
    n_vis = int(emb.shape[0])
    # Rows padded to a multiple of 256 as in lrl.tasks.video (fewer recompilations across rows).
    table, _ = embed_cache.build_table([emb], text.d_model, text.dtype, pad_to=256)
    table = jax.device_put(table, mesh_lib.replicated(mesh))

    # The prompt: a question around the video, M-RoPE positions, embeddings with the table.
    ids = np.array([1, c.vision_start_token_id] + [c.video_token_id] * n_vis
                   + [c.vision_end_token_id] + list(range(10, 42)), np.int32)
    pos, delta = vl.mrope_positions(c, ids, video_grids=[grid])
    embeds = vl.embed_tokens(text, params, ids[None], table, vl.visual_index(c, ids[None]))[0]
    T = len(ids)
    out.update(visual_tokens=n_vis, prompt_tokens=T)

    # Stage 2 for the rollout: the prompt's K/V into pages.
    ps = args.page_size
    engine = Engine(text, EngineConfig(page_size=ps, num_pages=pages_for(T, ps) + 2, max_slots=1,
                                       max_pages_per_slot=pages_for(T, ps)), mesh)
    state = engine.init_decode_state()
    fill = (sp_prefill.make_prefill(mesh) if seq > 1
            else lambda e, p, st, pre: e.run_prefill(p, st, pre))
    for key in ("prefill_compile_s", "prefill_s"):
        prefix = engine.reserve_prefix(ids, embeds, pos)
        t0 = time.perf_counter()
        state = fill(engine, params, state, [prefix])
        jax.block_until_ready(state.k_pages)
        out[key] = time.perf_counter() - t0
        engine.release(prefix)
    del state, engine, embeds, params

    # Stage 2 for the update: one packed row of prompt + completion, split over seq.
    n = T + args.new_tokens
    unit = 2 * seq * 128
    row_len = -(-n // unit) * unit
    tokens = np.zeros((1, row_len), np.int32)
    tokens[0, :T] = ids
    tokens[0, T:n] = rng.integers(0, text.vocab_size - 8, args.new_tokens)
    seg = (np.arange(row_len) < n).astype(np.int32)[None]
    positions = np.zeros((1, 3, row_len), np.int32)
    positions[0, :, :n] = vl.extend_positions(pos, delta, n)
    mask = ((np.arange(row_len) >= T - 1) & (np.arange(row_len) < n - 1)).astype(np.float32)[None]
    batch = mesh_lib.put_batch(mesh, {
        "tokens": tokens, "positions": positions, "segment_ids": seg,
        "targets": np.roll(tokens, -1, axis=1) * seg, "loss_mask": mask,
        "advantages": np.full((1, row_len), 0.5, np.float32),
        "visual_index": vl.visual_index(c, tokens, seg, np.array([[-1, 0]]),
                                        np.array([[0, n_vis]]))})
    for key in ("update_compile_s", "update_s"):
        t0 = time.perf_counter()
        ctx["state"], metrics = ctx["update"](ctx["state"], batch, table)
        jax.block_until_ready(metrics)
        out[key] = time.perf_counter() - t0
    out["update_tokens"] = row_len
    return out


def child(seq: int, frames: list[int], args) -> None:
    """Rows of one seq setting, reported line by line; the first out-of-memory row ends the
    process (the parent starts a fresh one for the rest)."""
    ctx = setup(seq, args)
    for f in frames:
        print(f"ROW {f}", flush=True)
        try:
            r = run_row(ctx, f, args)
        except Exception as e:  # noqa: BLE001  (any failure of one row is that row's result)
            text = f"{type(e).__name__}: {e}"
            oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
            print("FAILED " + json.dumps({"frames": f, "why": "OOM" if oom else
                                          "error: " + text.splitlines()[0][:120]}), flush=True)
            if oom:
                sys.exit(3)
            continue
        print("RESULT " + json.dumps({"frames": f, **r}), flush=True)


def device_count(env) -> int:
    code = "import jax; print(jax.device_count())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"cannot count devices: {res.stderr[-2000:]}")
    return int(res.stdout.strip().splitlines()[-1])


def child_env(small: bool, devices: int) -> dict:
    env = dict(os.environ)
    if small:   # CPU with virtual devices, so that the seq=n path runs too
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices}").strip()
    return env


def _reader(proc, lines: queue.Queue):
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def spawn(seq: int, frames: list[int], args, env) -> dict:
    """frames -> result dict or "OOM" / "timeout" / "error: ...", each row under --budget-s
    (a child's set-up counts towards its first row); a killed or failed child is replaced by
    a fresh one for the remaining rows."""
    results, pending = {}, list(frames)
    while pending:
        cmd = [sys.executable, __file__, "--child", f"{seq}:{','.join(map(str, pending))}",
               "--tokens-per-frame", str(args.tokens_per_frame),
               "--new-tokens", str(args.new_tokens), "--page-size", str(args.page_size),
               "--frame-chunk", str(args.frame_chunk)] + (["--small"] if args.small else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
        current, deadline, tail = pending[0], time.time() + args.budget_s, []
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.time(), 0.01))
            except queue.Empty:
                proc.kill()
                results[current] = "timeout"
                break
            if line is None:   # the child ended
                if current in pending and current not in results:
                    oom = any("RESOURCE_EXHAUSTED" in t or "out of memory" in t.lower()
                              for t in tail)
                    results[current] = "OOM" if oom else (
                        "error: " + (tail[-1].strip()[:120] if tail else "no output"))
                break
            tail = (tail + [line])[-20:]
            if line.startswith("ROW "):
                current, deadline = int(line.split()[1]), time.time() + args.budget_s
            elif line.startswith(("RESULT ", "FAILED ")):
                print(f"seq={seq} {line.strip()}", flush=True)  # kept if a later row hangs
                r = json.loads(line.split(" ", 1)[1])
                results[r.pop("frames")] = r if line.startswith("RESULT") else r["why"]
        proc.wait()
        pending = [f for f in pending if f not in results]
    return results


def table(rows) -> str:
    head = ("| frames | visual tokens | update tokens | seq | cache | vision s | prefill s | "
            "update s | step s |\n|---:|---:|---:|---:|:---|---:|---:|---:|---:|")
    lines = [head]
    for frames, seq, r in rows:
        if isinstance(r, str):
            lines.append(f"| {frames} | | | {seq} | | {r} | | | |")
            continue
        for cache, vis in (("off", r["vision_cold_s"]), ("on", r["vision_hit_s"])):
            total = vis + r["prefill_s"] + r["update_s"]
            lines.append(f"| {frames} | {r['visual_tokens']} | {r['update_tokens']} | {seq} | "
                         f"{cache} | {vis:.3f} | {r['prefill_s']:.3f} | {r['update_s']:.3f} | "
                         f"{total:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", default=None,
                   help="comma-separated frame counts (default 8,...,1024; --small: 4,8)")
    p.add_argument("--tokens-per-frame", type=int, default=None,
                   help="merged tokens per temporal patch (default 64; --small: 4)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="completion tokens in the update row (default 512; --small: 8)")
    p.add_argument("--seq", type=int, default=0, help="the seq=n rows' n (default: all devices)")
    p.add_argument("--skip-seq1", action="store_true", help="only the seq=n rows")
    p.add_argument("--budget-s", type=float, default=900.0, help="seconds per row at most")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--frame-chunk", type=int, default=16, help="frames per device per call")
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU (2 virtual devices)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    small = args.small
    args.tokens_per_frame = args.tokens_per_frame or (4 if small else 64)
    args.new_tokens = args.new_tokens or (8 if small else 512)
    args.page_size = args.page_size or (16 if small else 64)
    if args.child:
        seq, frames = args.child.split(":")
        child(int(seq), [int(x) for x in frames.split(",")], args)
        return
    frames = [int(x) for x in (args.frames or ("4,8" if small else
                                               "8,16,32,64,128,256,512,1024")).split(",")]
    env = child_env(small, 2)
    n = args.seq or device_count(env)
    seqs = ([] if args.skip_seq1 and n > 1 else [1]) + ([n] if n > 1 else [])
    print(f"# video frames: {'tiny CPU' if small else 'Qwen2.5-VL-7B'} shapes, "
          f"{args.tokens_per_frame} tokens per temporal patch, {args.new_tokens} new tokens, "
          f"seq in {seqs}, budget {args.budget_s:.0f} s per row", flush=True)
    by_seq = {}
    for s in seqs:
        t0 = time.time()
        by_seq[s] = spawn(s, frames, args, env)
        print(f"seq={s}: " + ", ".join(f"{f} frames {r if isinstance(r, str) else 'ok'}"
                                       for f, r in by_seq[s].items())
              + f" ({time.time() - t0:.0f} s)", flush=True)
    print(table([(f, s, by_seq[s][f]) for f in frames for s in seqs]))


if __name__ == "__main__":
    main()
