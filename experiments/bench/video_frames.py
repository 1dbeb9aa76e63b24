"""Video GRPO step time against frame count: vision encode, rollout prefill and the policy
update of one video prompt and its G answers, with and without the embedding cache (MR-SP
stage 1), the engine's chunked prefill against the whole-prompt one, the update's rows
unshared against the shared prompt (`rl.shared_prompt`, `lrl.data.shared_prompt`), and with
and without sequence parallelism (MR-SP stage 2: seq=1 vs seq=n over all n devices).

Qwen2.5-VL-7B shapes with random weights (bf16 compute and storage, SGD so that the 7B update
fits one H200: the step's time, not an optimizer's memory, is measured here). The SGD step's
learning rate is 0: it computes and applies the update as any step does, but the weights stay
put, so every layout and row steps from the same parameters and the layouts' losses compare
exactly. A prompt is one video of `frames` frames at --tokens-per-frame merged tokens per
temporal patch (2 frames), so frames/2 x tokens-per-frame visual tokens, plus a short
question; each of its --answers G answers has --new-tokens tokens.

    python experiments/bench/video_frames.py                       # GPU(s): markdown table
    python experiments/bench/video_frames.py --frames 8,64,512 --tokens-per-frame 128
    python experiments/bench/video_frames.py --frames 64,512,1024 --answers 8 \
        --shared-prompt off,on                                     # the shared prompt's gain
    python experiments/bench/video_frames.py --small               # CPU smoke (a minute)

Each seq setting runs in a subprocess that builds the model once and then the rows in order
of frame count. A row that runs out of memory prints "OOM" and ends its subprocess; a row
that takes longer than --budget-s (the subprocess's set-up counts towards its first row) is
killed and prints "timeout"; a fresh subprocess then continues with the next row. Inside a
row every stage runs once to compile and once timed (the update compiles on a step over its
first micro-batch only). Columns:
- vision s: the frames through the vision tower (split over the row's devices); hit s: a
  cache hit (key from the video file's path, mtime and size: no tower call). Decoding the
  mp4 is not included (frames are random patches).
- prefill s, per --prefill path, the prompt's K/V into the engine's pages, on the training
  params (the loop hands the engine its decode layout): chunked, the engine's prefill in
  chunks of --prefill-chunk tokens, each later chunk reading the earlier chunks' pages (the
  XLA paged path); whole, one call over the whole prompt, on one device the engine's
  whole-prompt call (`EngineConfig.prefill_lengths`, cuDNN attention on GPU) and on seq=n
  `lrl.rollout.sp_prefill` (the training forward with ring attention over n devices; seq=n
  rows have no chunked column).
- update s, per --shared-prompt layout, one optimizer step as the GRPO loop runs it
  (`lrl.rl.update.run_update`: one `accumulate` call per micro-batch, then `apply`) on the
  G answers packed as `lrl.grpo.pack` packs them (`lrl.data.packing` / `pack_groups`, the
  visual rows by `lrl.tasks.video.add_visual_rows`): off, G rows of prompt + answer, one a
  micro-batch; on, one row of the prompt once then the G answers (`prefix_ids`). Dense
  attention on one device, ring over n devices. Old log-probs near a random policy's, so the
  loss depends on the forward: both layouts must give the same loss and gradient norm (within
  --rtol; the script exits non-zero when they do not). Both are printed.
- step s: vision (cache off) + prefill + update, for the first prefill path and layout
  listed, and for the last (decode, the same for both, is left out); speedup: their ratio.
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
from experiments.bench.profile import sibling  # noqa: E402


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

    text, vcfg = configs(args.small)
    mesh = mesh_lib.make_mesh({"seq": seq}, devices=jax.devices()[:seq])
    text = text.replace(attention="ring" if seq > 1 else "dense",
                        remat="none" if args.small else args.remat)
    c = vl.VLConfig(text, vcfg, image_token_id=text.vocab_size - 4,
                    video_token_id=text.vocab_size - 3,
                    vision_start_token_id=text.vocab_size - 2,
                    vision_end_token_id=text.vocab_size - 1)
    k1, k2 = jax.random.split(jax.random.key(0))
    tx = optax.sgd(0.0)   # the same work as any step; the parameters stay put (docstring)
    state = jax.jit(lambda k: update_lib.init_train_state(models.init_params(text, k), tx),
                    out_shardings=update_lib.train_state_shardings(text, tx, mesh))(k1)
    vparams = jax.jit(vision.init_vision_params, static_argnums=0,
                      out_shardings=mesh_lib.replicated(mesh))(vcfg, k2)
    return dict(seq=seq, mesh=mesh, text=text, vcfg=vcfg, c=c, state=state, vparams=vparams,
                tx=tx,
                encoder=embed_cache.make_encoder(vcfg, mesh, frame_chunk=args.frame_chunk))




def prefill_row(ctx: dict, path: str, ids, embeds, pos, args) -> dict:
    """Seconds of the prompt's prefill by `path` (compiled first): "chunked", the engine's
    chunks of --prefill-chunk; "whole", its whole-prompt call (seq=1) or `sp_prefill`."""
    import jax
    from lrl.rollout import Engine, EngineConfig, pages_for, sp_prefill
    from lrl.rollout.steps import whole_prefill_lengths

    T, ps, C = len(ids), args.page_size, args.prefill_chunk
    lengths = whole_prefill_lengths(C, T - 1, 1 << 30) if path == "whole" else ()
    engine = Engine(ctx["text"], EngineConfig(page_size=ps, num_pages=pages_for(T, ps) + 2,
                                              max_slots=1, max_pages_per_slot=pages_for(T, ps),
                                              prefill_chunk=C, prefill_lengths=lengths),
                    ctx["mesh"])
    fill = (sp_prefill.make_prefill(ctx["mesh"]) if ctx["seq"] > 1
            else lambda e, p, st, pre: e.run_prefill(p, st, pre))
    state, params = engine.init_decode_state(), ctx["state"].params
    out = {}
    for key in ("compile_s", "s"):
        prefix = engine.reserve_prefix(ids, embeds, pos)
        t0 = time.perf_counter()
        state = fill(engine, params, state, [prefix])
        jax.block_until_ready(state.k_pages)
        out[key] = time.perf_counter() - t0
        engine.release(prefix)
    out["call"] = (f"sp over seq={ctx['seq']}" if ctx["seq"] > 1 else f"chunks of {C}"
                   if path == "chunked" else f"1 x {engine.ecfg.whole_length(T - 1)}")
    return out


def update_row(ctx: dict, layout: str, prompt, table, args, seed: int) -> dict:
    """One optimizer step on the prompt's G answers in `layout` ("off": unshared rows, "on":
    the shared prompt), as the loop runs it: -> seconds, rows, metrics of the timed step."""
    import jax
    import numpy as np
    from lrl import mesh as mesh_lib
    from lrl.models import vl
    from lrl.rl import update as update_lib
    from lrl.rl.losses import LossConfig

    text, mesh = ctx["text"], ctx["mesh"]
    G, A = args.answers, args.new_tokens
    rng = np.random.default_rng(seed)        # the same answers for both layouts
    vocab = text.vocab_size - 8              # clear of the vision token ids
    comps = [rng.integers(0, vocab, A).astype(np.int32) for _ in range(G)]
    adv = rng.standard_normal(G).astype(np.float32)
    # Old log-probs near a random policy's: the ratios, and the loss, depend on the forward.
    old = [rng.normal(-np.log(text.vocab_size), 0.1, A).astype(np.float32) for _ in range(G)]
    micro, _ = sibling("shared_prompt").rows("unshared" if layout == "off" else "shared",
                                            ctx["c"], [prompt] * G, comps, adv, old,
                                            align=2 * ctx["seq"] * 128)
    denoms = update_lib.host_denominators(micro, A)
    placed = [mesh_lib.put_batch(mesh, mb) for mb in micro]
    # The update for these rows, with the runs a row may hold as the loop sets them (the
    # packed backward's buffers grow with them).
    runs = sibling("shared_prompt").with_runs(text, micro, "unshared" if layout == "off"
                                              else "shared", G)
    u = update_lib.make_update_programs(runs, LossConfig(max_len=A), ctx["tx"], mesh,
                                        hidden=vl.batch_hidden_states,
                                        extra_keys=("visual_index",))
    p, params = u.programs, ctx["state"].params
    # The optimizer step compiles first, before the forward's buffers come and go, and that
    # executable runs it, so the temporaries read here are those of the program that runs
    # (0 GiB at 1,024 frames on one H200).
    t0 = time.perf_counter()
    stage = ctx["stage"]
    ctx["stage"] = f"{stage}: apply compile"
    acc_shape = jax.eval_shape(p.start, params, placed[0], denoms, table)
    apply = p.apply.lower(ctx["state"], acc_shape).compile()
    ctx["apply_temp_gib"] = round(apply.memory_analysis().temp_size_in_bytes / 2**30, 2)
    p = p._replace(apply=apply)
    u = u._replace(programs=p)
    ctx["stage"] = f"{stage}: step"
    # Compiles start, accumulate (on one micro-batch) and apply: one step on one row.
    acc = p.accumulate(params, p.start(params, placed[0], denoms, table), placed[0], denoms,
                       table)
    del params
    ctx["state"], m = p.apply(ctx["state"], acc)
    # The accumulator is not donated to apply: held here, its 14 GiB (7B, bf16) sat beside
    # the timed step's own, and the 1,024-frame row's 88.6 GiB request for the forward's
    # temporaries fell 0.1 GiB short of the device (docs/benchmark-history.md,
    # "Fourteenth session").
    del acc
    jax.block_until_ready(m)
    out = {"compile_s": time.perf_counter() - t0,
           "apply_temp_gib": ctx["apply_temp_gib"]}
    t0 = time.perf_counter()
    ctx["state"], m = update_lib.run_update(u, ctx["state"], placed, denoms, table)
    m = jax.device_get(m)
    out["s"] = time.perf_counter() - t0
    T = int(micro[0]["tokens"].shape[1])
    return {**out, "rows": f"{len(micro)} x {T}", "tokens": len(micro) * T,
            "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}


def run_row(ctx: dict, frames: int, args) -> dict:
    """One row: seconds per stage for a prompt of `frames` frames and its G answers."""
    import jax
    import numpy as np
    from lrl import mesh as mesh_lib
    from lrl.data.video import VisualItem
    from lrl.models import embed_cache, vl
    from lrl.tasks import Prompt, video

    mesh, text, vcfg, c = ctx["mesh"], ctx["text"], ctx["vcfg"], ctx["c"]
    out = {}
    ctx["stage"] = "vision"
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
    embeds = vl.embed_tokens(text, ctx["state"].params, ids[None], table,
                             vl.visual_index(c, ids[None]))[0]
    out.update(visual_tokens=n_vis, prompt_tokens=len(ids))

    # Stage 2 for the rollout: the prompt's K/V into pages, by each prefill path.
    out["prefill"] = {}
    for path in args.prefill:
        if path == "chunked" and ctx["seq"] > 1:
            continue                 # seq=n: the loop prefills long prompts with sp_prefill
        ctx["stage"] = f"prefill {path}"
        out["prefill"][path] = prefill_row(ctx, path, ids, embeds, pos, args)
    del embeds

    # Stage 2 for the update: the G answers in each layout.
    prompt = Prompt(ids, "", {}, "", visual=video.VisualRows(None, n_vis, pos, delta))
    out["update"] = {}
    for lay in args.shared_prompt:
        ctx["stage"] = f"update {lay}"
        out["update"][lay] = update_row(ctx, lay, prompt, table, args, seed=frames)
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
                                          "error: " + text.splitlines()[0][:120],
                                          "stage": ctx.get("stage"), "memory": _memory(),
                                          "apply_temp_gib": ctx.get("apply_temp_gib"),
                                          "detail": text[:300]}),
                  flush=True)
            if oom:
                sys.exit(3)
            continue
        print("RESULT " + json.dumps({"frames": f, **r}), flush=True)


def _memory() -> dict:
    """GiB in use and at the peak on the first device, where the backend reports them."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {k: round(stats[k] / 2**30, 1) for k in ("bytes_in_use", "peak_bytes_in_use",
                                                    "bytes_limit") if k in stats}


def device_count(env) -> int:
    code = "import jax; print(jax.device_count())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"cannot count devices: {res.stderr[-2000:]}")
    return int(res.stdout.strip().splitlines()[-1])


def child_env(small: bool, devices: int) -> dict:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")   # the 7B step needs the room
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
               "--frame-chunk", str(args.frame_chunk), "--answers", str(args.answers),
               "--remat", args.remat, "--shared-prompt", ",".join(args.shared_prompt),
               "--prefill", ",".join(args.prefill),
               "--prefill-chunk", str(args.prefill_chunk)] + (["--small"] if args.small else [])
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


def table(rows, args) -> tuple[str, bool]:
    """The markdown table -> (table, whether every row's layouts agree on the loss and the
    gradient norm within --rtol)."""
    paths, lays = args.prefill, args.shared_prompt
    first, last = (paths[0], lays[0]), (paths[-1], lays[-1])
    steps = [first] + ([last] if last != first else [])
    head = (["frames", "visual tokens", "seq", "vision s", "hit s"]
            + [f"prefill s, {p}" for p in paths]
            + [x for lay in lays for x in (f"update rows x T, {lay}", f"update s, {lay}")]
            + (["update speedup"] if len(lays) > 1 else [])
            + [f"step s, {p} / {lay}" for p, lay in steps]
            + (["step speedup"] if len(steps) > 1 else [])
            + [f"loss, {lay}" for lay in lays] + [f"grad norm, {lay}" for lay in lays]
            + (["max rel diff"] if len(lays) > 1 else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    ok = True
    for frames, seq, r in rows:
        if isinstance(r, str):
            lines.append(f"| {frames} | | {seq} | {r} |" + " |" * (len(head) - 4))
            continue
        pre, upd = r["prefill"], r["update"]
        cells = [frames, r["visual_tokens"], seq, f"{r['vision_cold_s']:.3f}",
                 f"{r['vision_hit_s']:.3f}"]
        cells += [f"{pre[p]['s']:.3f}" if p in pre else "" for p in paths]
        for lay in lays:
            cells += [upd[lay]["rows"], f"{upd[lay]['s']:.3f}"]
        if len(lays) > 1:
            cells.append(f"{upd[lays[0]]['s'] / upd[lays[-1]]['s']:.2f}x")
        totals = []
        for p, lay in steps:
            p = p if p in pre else next(iter(pre))     # seq=n: the one path it has
            totals.append(r["vision_cold_s"] + pre[p]["s"] + upd[lay]["s"])
            cells.append(f"{totals[-1]:.3f}")
        if len(steps) > 1:
            cells.append(f"{totals[0] / totals[-1]:.2f}x")
        cells += [f"{upd[lay]['loss']:.6g}" for lay in lays]
        cells += [f"{upd[lay]['grad_norm']:.6g}" for lay in lays]
        if len(lays) > 1:
            base = upd[lays[0]]
            worst = max(abs(upd[lay][k] - base[k]) / max(abs(base[k]), 1e-12)
                        for lay in lays[1:] for k in ("loss", "grad_norm"))
            ok = ok and worst <= args.rtol
            cells.append(f"{worst:.1e}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines), ok


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
    p.add_argument("--remat", default="full",
                   help="the decoder's remat policy in the update (lrl.models.layers)")
    p.add_argument("--answers", type=int, default=1,
                   help="G: answers of --new-tokens each per prompt in the update (default 1)")
    p.add_argument("--shared-prompt", default="off",
                   help="update layouts, comma-separated: off (G rows each holding the prompt), "
                        "on (the prompt once, then the G answers)")
    p.add_argument("--prefill", default="chunked,whole",
                   help="prefill paths, comma-separated: chunked, whole")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the engine's prefill chunk (default 4096; --small: 16)")
    p.add_argument("--rtol", type=float, default=None,
                   help="the layouts' loss and gradient norm must agree to this (default 2e-2, "
                        "--small 1e-5)")
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU (2 virtual devices)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    small = args.small
    args.tokens_per_frame = args.tokens_per_frame or (4 if small else 64)
    args.new_tokens = args.new_tokens or (8 if small else 512)
    args.page_size = args.page_size or (16 if small else 64)
    args.prefill_chunk = args.prefill_chunk or (16 if small else 4096)
    args.rtol = args.rtol if args.rtol is not None else (1e-5 if small else 2e-2)
    args.shared_prompt = args.shared_prompt.split(",")
    args.prefill = args.prefill.split(",")
    if not set(args.shared_prompt) <= {"off", "on"} or not set(args.prefill) <= {"chunked",
                                                                                  "whole"}:
        p.error("--shared-prompt takes off / on, --prefill chunked / whole")
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
          f"{args.tokens_per_frame} tokens per temporal patch, G={args.answers} answers of "
          f"{args.new_tokens} tokens, prefill {'/'.join(args.prefill)} (chunks of "
          f"{args.prefill_chunk}), shared prompt {'/'.join(args.shared_prompt)}, "
          f"{args.remat} remat, seq in {seqs}, budget {args.budget_s:.0f} s per row", flush=True)
    by_seq = {}
    for s in seqs:
        t0 = time.time()
        by_seq[s] = spawn(s, frames, args, env)
        print(f"seq={s}: " + ", ".join(f"{f} frames {r if isinstance(r, str) else 'ok'}"
                                       for f, r in by_seq[s].items())
              + f" ({time.time() - t0:.0f} s)", flush=True)
    text, ok = table([(f, s, by_seq[s][f]) for f in frames for s in seqs], args)
    print(text)
    if len(args.shared_prompt) > 1:
        print(f"\nloss and grad norm agree across layouts within rtol {args.rtol}: {ok}")
    failed = [f for s in seqs for f in frames if isinstance(by_seq[s][f], str)]
    if not ok or (small and failed):
        sys.exit(1)


if __name__ == "__main__":
    main()
