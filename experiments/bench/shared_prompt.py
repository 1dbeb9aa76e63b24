"""The shared-prompt update (`rl.shared_prompt`, lrl.data.shared_prompt) against the unshared
one, on one accelerator: update time for one group of a long prompt and G answers.

One GRPO optimizer step as the loop runs it (`lrl.rl.update.run_update`: one compiled
`accumulate` call per micro-batch, then `apply`), random weights and tokens, for a prompt of
P tokens and G answers of A tokens packed two ways:

  unshared  G rows of P + A tokens, one sample a row: G micro-batches of one row
  shared    the prompt once, then its G answers (each opened by the prompt's last token):
            one row of P - 1 + G (A + 1) tokens, one micro-batch

Both steps start from the same parameters, with old log-probs near a random policy's (so
the clipped ratios, and the loss, depend on the forward) and an entropy bonus, so their loss,
entropy, ratios and gradient norm must be equal (the layout is exact): the table gives the
largest relative difference, and the script exits non-zero when it is above --rtol (bf16
compute: 2e-2 by default; --tiny runs fp32, 1e-4).

    python experiments/bench/shared_prompt.py                  # Qwen2.5-1.5B shapes, one GPU
    python experiments/bench/shared_prompt.py --vl7b           # Qwen2.5-VL-7B's decoder, a
                                                               # video prompt (visual table)
    python experiments/bench/shared_prompt.py --tiny [--vl7b]  # CPU, tiny shapes: checks it

Defaults: prompts of 8K, 32K and 128K tokens, G = 8 answers of 1K. Each prompt length runs
in its own subprocess (its own peak memory); a mode that fails (out of memory, mostly) prints
its error in the table and the other still runs. A mode whose row has --fit-check-from tokens
or more is compiled first and skipped, with its estimate ("skipped: est. X GiB"), when it
cannot fit the device. The "kernels" column says which kernel each attention block took: on
a GPU in bf16, cuDNN for the unshared rows and for both blocks of the shared rows (the self
block as cuDNN's packed segments, the prefix block as its packed runs of responses against
their prefix, `lrl.models.shared_attention`); XLA's blockwise kernel elsewhere.

The two numbers of METHOD.md, per mode, from the packed rows themselves:
- FLOPs: 6 x (matmul parameters) per real token (forward and backward; the lm head over
  every position, the embedding lookup not counted) + 12 x L x N x H per attended (query,
  key) pair (QK^T and PV, forward and backward). Attended pairs: s (s + 1) / 2 for a segment
  of s tokens, plus s x p for a response segment reading its prompt prefix of p tokens. So
  the shared layout saves (G - 1) prompts' matmuls and (G - 1) prompts' self-attention, and
  adds only each answer's block on the prompt. Remat's recomputed forward is not counted
  (the same in both modes): MFU-style, as train_step.py counts.
- Bytes: the train state read once and written once (master params and optimizer state);
  against the FLOPs this term is small at these lengths (printed so the floor says so).
The floor is the larger of FLOPs / --peak-tflops and bytes / --peak-gbs; "x floor" is the
measured step over it, "flop ratio" the speedup the count predicts for shared over unshared.

Qwen2.5-1.5B: fp32 master weights, bf16 compute, AdamW. Qwen2.5-VL-7B: bf16 weights and
SGD, as video_frames.py runs it (the step's time on one H200, not an optimizer's memory); the
prompt is a vision-start token, P - 34 video tokens (whole temporal patches of
--tokens-per-frame) read from a random visual table, a vision-end token and a 32-token
question, with M-RoPE positions; only the text decoder trains (the tower is frozen and its
output is an input of the update, so it costs the same in both modes and is left out).

P prompt tokens · G answers per prompt · A answer tokens · L layers · N query heads ·
H head dim · T positions in a row.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from anywhere
from experiments.bench.profile import sibling  # noqa: E402
ALIGN = 128                    # row lengths: a multiple of the kernels' tiles
QUESTION = 32                  # text tokens after a video prompt's visual tokens




def model(vl7b: bool, tiny: bool, remat: str):
    """-> (text ModelConfig, VLConfig or None, optimizer)."""
    import jax.numpy as jnp
    import optax
    from lrl.models import vl
    from lrl.rl import optim
    if vl7b:
        text, vcfg = sibling("video_frames").configs(tiny)
        text = text.replace(remat="none" if tiny else remat, attention="dense")
        c = vl.VLConfig(text, vcfg, image_token_id=text.vocab_size - 4,
                        video_token_id=text.vocab_size - 3,
                        vision_start_token_id=text.vocab_size - 2,
                        vision_end_token_id=text.vocab_size - 1)
        return text, c, optax.sgd(1e-6)
    ts = sibling("train_step")
    make = ts.tiny if tiny else ts.qwen25_15b
    text = make(dtype=jnp.float32 if tiny else jnp.bfloat16, param_dtype=jnp.float32,
                remat="none" if tiny else remat, attention="dense")
    return text, None, optim.make_optimizer(lr=1e-6, warmup_steps=1, total_steps=100)


def _round_up(n: int, unit: int = ALIGN) -> int:
    return -(-n // unit) * unit


def group(cfg, vl_cfg, P: int, G: int, A: int, tokens_per_frame: int, seed: int = 0):
    """One prompt (Prompt objects, one per answer) and G random answers -> (prompts,
    completions, advantages [G], old log-probs [G][A])."""
    import numpy as np
    from lrl.models import vl
    from lrl.tasks import Prompt, video
    rng = np.random.default_rng(seed)
    text_vocab = cfg.vocab_size - 8          # clear of the vision token ids
    if vl_cfg is None:
        p = Prompt(rng.integers(0, text_vocab, P).astype(np.int32), "", {}, "")
    else:
        m = vl_cfg.vision.spatial_merge_size
        r, c = sibling("video_frames").merged_grid(tokens_per_frame)
        t = max(1, (P - 2 - QUESTION) // tokens_per_frame)
        grid = (t, r * m, c * m)                 # in patches, as the processor reports it
        n = vl_cfg.tokens_per_item(grid)
        ids = np.concatenate([[vl_cfg.vision_start_token_id], [vl_cfg.video_token_id] * n,
                              [vl_cfg.vision_end_token_id],
                              rng.integers(0, text_vocab, QUESTION)]).astype(np.int32)
        pos, delta = vl.mrope_positions(vl_cfg, ids, video_grids=[grid])
        p = Prompt(ids, "", {}, "", visual=video.VisualRows(None, n, pos, delta))
    comps = [rng.integers(0, text_vocab, A).astype(np.int32) for _ in range(G)]
    # Old log-probs near a random policy's (-log V), so the clipped ratios, and with them the
    # loss, depend on the policy's log-probs (on-policy, the loss would be -mean(advantage)
    # whatever the forward computed).
    old = [rng.normal(-np.log(cfg.vocab_size), 0.1, A).astype(np.float32) for _ in range(G)]
    return [p] * G, comps, rng.standard_normal(G).astype(np.float32), old


def rows(mode: str, vl_cfg, prompts, comps, adv, old, align: int = ALIGN):
    """The group packed as `lrl.grpo.pack` packs it, in rows of a multiple of `align` tokens
    -> (host micro-batches of one row, layout). A group of one answer shares nothing."""
    import numpy as np
    from lrl.data import packing
    from lrl.data import shared_prompt as sp
    from lrl.tasks import video
    G, P, A = len(comps), len(prompts[0].ids), len(comps[0])
    ids = [p.ids for p in prompts]
    kw = dict(seq_values={"advantages": adv}, token_values={"old_logp": old})
    if mode == "unshared":
        batch, layout = packing.pack(ids, comps, _round_up(P + A, align), fit="best", **kw)
    else:
        g = np.zeros(G, np.int64)
        share = sp.share_groups(g, [P] * G, [A] * G, "on")
        n = P - 1 + G * (A + 1) if G > 1 else P + A
        batch, layout = sp.pack_groups(ids, comps, _round_up(n, align), groups=g, share=share,
                                       **kw)
        assert layout["shared"].all() or G == 1, "the group was not shared"
    if vl_cfg is not None:
        batch = video.add_visual_rows(vl_cfg, batch, layout, prompts, [0] * G)
    return packing.micro_batches(batch, packing.Cut(1, 1, (batch["tokens"].shape[1],))), layout


def with_runs(cfg, micro, mode: str, G: int):
    """`cfg` with the runs a row may hold on cuDNN's packed attention, as the build sets them
    for its rows' length (`lrl.build.with_update_runs`): 64 runs took 0.75 MiB a token of
    the packed backward's buffers at 1.5B shapes, whatever the rows held."""
    from lrl import build
    return build.with_update_runs(cfg, int(micro[0]["tokens"].shape[1]),
                                 0 if mode == "unshared" else G)


def counts(cfg, n_params: int, state_bytes: int, micro) -> dict:
    """FLOPs, bytes and real tokens of one step over `micro` (module docstring)."""
    import numpy as np
    tokens = pairs = 0
    for mb in micro:
        for seg, pre in zip(mb["segment_ids"], mb.get("prefix_ids", np.zeros_like(
                mb["segment_ids"]))):
            lens = np.bincount(seg)[1:].astype(np.int64)     # tokens of segment id 1, 2, ...
            tokens += int(lens.sum())
            pairs += int((lens * (lens + 1) // 2).sum())
            reads = (pre > 0) & (pre != seg)                 # response tokens: + their prefix
            pairs += int(lens[pre[reads] - 1].sum())
    matmul = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    flops = 6 * matmul * tokens + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs
    return {"tokens": tokens, "pairs": pairs, "flops": flops, "bytes": 2 * state_bytes,
            "rows": sum(mb["tokens"].shape[0] for mb in micro),
            "row_len": int(micro[0]["tokens"].shape[1])}


def kernels(cfg, mode: str) -> str:
    """Which kernel each attention block takes here for the model's dtype and heads: the
    unshared rows' dense attention, the shared rows' self and prefix blocks
    (`lrl.models.shared_attention.kernel`)."""
    import jax
    from lrl.models import flash
    from lrl.models import shared_attention as sa
    q = jax.ShapeDtypeStruct((1, 1, cfg.n_heads, cfg.head_dim), cfg.dtype)
    k = jax.ShapeDtypeStruct((1, 1, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)
    if mode == "unshared":
        return "dense " + flash._pick(cfg.attention_impl, q, k, need_bwd=False, where="bench")
    impl = sa.kernel(q, k, cfg.attention_impl)
    return f"self {impl} / prefix {impl}"


def fits(u, state, placed, extra, state_bytes: int) -> tuple[float, float]:
    """(estimated GiB, device GiB) of one micro-batch's accumulate program, compiled, not
    run (`lrl.rl.update.need_bytes`), plus the train state; device GiB 0 when unknown."""
    import jax
    from lrl.rl import update as update_lib
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    need = update_lib.need_bytes(u, state.params, jax.tree.map(spec, placed[0]),
                                 None if extra is None else spec(extra))
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    return (need + state_bytes) / 2**30, limit / 2**30


def one(mode: str, P: int, a) -> dict:
    """One step of `mode` for a prompt of P tokens: compiled (the first step, whose metrics
    are compared), then --repeats steps timed, the median reported."""
    import jax
    import numpy as np
    from lrl import mesh as mesh_lib
    from lrl.models import vl
    from lrl.rl import losses
    from lrl.rl import update as update_lib

    cfg, vl_cfg, tx = model(a.vl7b, a.tiny, a.remat)
    mesh = mesh_lib.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    prompts, comps, adv, old = group(cfg, vl_cfg, P, a.group, a.answer, a.tokens_per_frame)
    micro, _ = rows(mode, vl_cfg, prompts, comps, adv, old)
    cfg = with_runs(cfg, micro, mode, a.group)
    extra = None
    kw = {}
    if vl_cfg is not None:
        n = prompts[0].visual.count
        table = jax.random.normal(jax.random.key(1), (_round_up(n, 256), cfg.d_model),
                                  cfg.dtype)
        extra = jax.device_put(table, mesh_lib.replicated(mesh))
        kw = dict(hidden=vl.batch_hidden_states, extra_keys=("visual_index",))
    loss_cfg = losses.LossConfig(aggregation="seq_mean_token_mean", max_len=a.answer,
                                 entropy_coef=0.01)
    u = update_lib.make_update_programs(cfg, loss_cfg, tx, mesh, chunk=a.chunk, **kw)
    state = update_lib.make_init_fn(cfg, tx, mesh)(jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    rec = {"mode": mode, "prompt": len(prompts[0].ids), "kernels": kernels(cfg, mode),
           **counts(cfg, n_params, state_bytes, micro)}
    print(f"{mode} P={P}: {rec['kernels']}", flush=True)
    denoms = update_lib.host_denominators(micro, a.answer)
    placed = [mesh_lib.put_batch(mesh, mb) for mb in micro]
    if rec["row_len"] >= a.fit_check_from:   # long rows: skip what cannot fit, say why
        est, limit = fits(u, state, placed, extra, state_bytes)
        rec["est_gib"] = est
        if limit and est > limit:
            return {**rec, "error": f"skipped: est. {est:.0f} GiB > {limit:.0f} GiB"}
    t0 = time.perf_counter()
    state, m = update_lib.run_update(u, state, placed, denoms, extra)
    first = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
    rec["first_step_s"] = time.perf_counter() - t0      # compiles, then runs
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        state, m = update_lib.run_update(u, state, placed, denoms, extra)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    return {**rec, "step_s": statistics.median(times), "steps_s": times, "metrics": first,
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30}


def child(P: int, a) -> None:
    cfg = model(a.vl7b, a.tiny, a.remat)[0]
    for mode in ("unshared", "shared"):
        try:
            rec = one(mode, P, a)
        except Exception as e:  # out of memory, mostly: record it, run the other mode
            rec = {"mode": mode, "prompt": P, "kernels": kernels(cfg, mode),
                   "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
        print("RESULT " + json.dumps(rec), flush=True)


COMPARED = ("loss", "pg_loss", "entropy", "ratio_mean", "grad_norm")   # grad_norm: gradients


def _row(P, mode: str, r: dict, base: dict, a) -> tuple[str, bool]:
    """One table line -> (line, whether its metrics agree with the unshared step's)."""
    kern = r.get("kernels", "")
    if "error" in r:
        return (f"| {P} | {mode} | {kern} | {r['error']} | | | | | | | | | | | |",
                r["error"].startswith("skipped"))
    floor = max(r["flops"] / (a.peak_tflops * 1e12), r["bytes"] / (a.peak_gbs * 1e9))
    m, rel, ratio, speed, ok = r["metrics"], "", "", "", True
    if mode == "shared" and "error" not in base:
        b = base["metrics"]
        worst = max((abs(m[k] - b[k]) / max(abs(b[k]), 1e-12), k) for k in COMPARED)
        rel = f"{worst[0]:.1e} ({worst[1]})"
        ok = worst[0] <= a.rtol
        ratio = f"{base['flops'] / r['flops']:.2f}x"
        speed = f"{base['step_s'] / r['step_s']:.2f}x"
    est = f" (est. {r['est_gib']:.0f})" if "est_gib" in r else ""
    return (f"| {r['prompt']} | {mode} | {kern} | {r['rows']} x {r['row_len']} | {r['tokens']} "
            f"| {r['flops'] / 1e12:.3g} | {floor * 1e3:.3g} | {r['step_s']:.3g} | "
            f"{r['step_s'] / floor:.1f} | {ratio} | {speed} | {r['peak_gib']:.1f}{est} | "
            f"{m['loss']:.6g} | {m['grad_norm']:.6g} | {rel} |", ok)


def table(results: dict, a) -> bool:
    """Prints the markdown table -> whether every shared step's metrics (`COMPARED`: loss and
    gradient norm among them, the correctness check) agreed with its unshared step's within
    --rtol; a mode skipped for memory counts as agreeing, a failed one does not."""
    ok = True
    shapes = ("tiny stand-in for " if a.tiny else "") + ("Qwen2.5-VL-7B (video prompt)"
                                                         if a.vl7b else "Qwen2.5-1.5B")
    print(f"\n# shared-prompt update: {shapes} shapes, G={a.group} answers of {a.answer} "
          "tokens\n")
    print("| prompt | mode | kernels | rows x T | tokens | TFLOP | floor ms | step s | x floor | "
          "flop ratio | speedup | peak GiB | loss | grad norm | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for P, recs in results.items():
        base = recs.get("unshared", {"error": "no result"})
        for mode in ("unshared", "shared"):
            r = recs.get(mode, {"error": "no result"})
            try:   # one malformed record still leaves the others' lines
                line, good = _row(P, mode, r, base, a)
            except Exception as e:
                line, good = f"| {P} | {mode} | | table: {type(e).__name__}: {e} |", False
            print(line)
            ok = ok and good
    print(f"\nfloor: FLOPs at {a.peak_tflops} TFLOP/s or state bytes at {a.peak_gbs} GB/s, "
          f"the larger; peak GiB: the device's peak in use (est.: compiled estimate, rows of "
          f"{a.fit_check_from}+ tokens); {', '.join(COMPARED)} agree within rtol {a.rtol}: "
          f"{ok}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="8192,32768,131072", help="prompt lengths (tokens)")
    ap.add_argument("--group", type=int, default=8, help="answers per prompt (G)")
    ap.add_argument("--answer", type=int, default=1024, help="tokens per answer (A)")
    ap.add_argument("--vl7b", action="store_true",
                    help="Qwen2.5-VL-7B's text decoder on a video prompt (else Qwen2.5-1.5B)")
    ap.add_argument("--tokens-per-frame", type=int, default=256,
                    help="--vl7b: merged visual tokens per temporal patch")
    ap.add_argument("--remat", default="full", help="remat policy of the decoder")
    ap.add_argument("--chunk", type=int, default=2048, help="log-prob chunk (tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps after the first")
    ap.add_argument("--peak-tflops", type=float, default=791.0,
                    help="bf16 matmul rate (train_step.py's measured H200 rate)")
    ap.add_argument("--peak-gbs", type=float, default=4800.0,
                    help="memory bandwidth, GB/s (the H200 datasheet's: a lead, not measured)")
    ap.add_argument("--rtol", type=float, default=None,
                    help="the compared metrics must agree to this (default 2e-2, --tiny 1e-4)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU: tiny shapes, prompts of 64 and 256, answers of 16, fp32 (--vl7b: "
                         "8 visual tokens a temporal patch)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip lengths that would start "
                    "later than this")
    ap.add_argument("--fit-check-from", type=int, default=65536,
                    help="rows of this many tokens or more: compile first and skip the mode, "
                         "with its estimate, when it cannot fit the device")
    ap.add_argument("--out", default="", help="write every result as JSON here")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny and a.prompts == ap.get_default("prompts"):
        a.prompts = "64,256"
    if a.tiny and a.answer == ap.get_default("answer"):
        a.answer = 16
    if a.tiny and a.tokens_per_frame == ap.get_default("tokens_per_frame"):
        a.tokens_per_frame = 8
    if a.rtol is None:
        a.rtol = 1e-4 if a.tiny else 2e-2
    if a.child:
        child(a.child, a)
        return
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    flags = [f"--group={a.group}", f"--answer={a.answer}", f"--remat={a.remat}",
             f"--chunk={a.chunk}", f"--repeats={a.repeats}",
             f"--tokens-per-frame={a.tokens_per_frame}", f"--fit-check-from={a.fit_check_from}"]
    flags += ["--vl7b"] * a.vl7b + ["--tiny"] * a.tiny
    results, t_start = {}, time.time()
    for P in (int(x) for x in a.prompts.split(",")):
        if a.budget_s and time.time() - t_start > a.budget_s:
            results[P] = {m: {"mode": m, "prompt": P, "error": "skipped (time budget)"}
                          for m in ("unshared", "shared")}
            continue
        try:   # one length's failure (a crashed child, even) still prints the others
            out = subprocess.run([sys.executable, __file__, f"--child={P}", *flags],
                                 capture_output=True, text=True, env=env)
            for x in out.stdout.splitlines():
                if not x.startswith("RESULT "):
                    print(x, flush=True)          # which kernels each block took
            recs = [json.loads(x[7:]) for x in out.stdout.splitlines()
                    if x.startswith("RESULT ")]
            err = (out.stderr.strip().splitlines() or ["?"])[-1][:200]
        except Exception as e:
            recs, err = [], f"{type(e).__name__}: {e}"[:200]
        results[P] = {r["mode"]: r for r in recs}
        for m in ("unshared", "shared"):
            results[P].setdefault(m, {"mode": m, "prompt": P, "error": err})
        for r in results[P].values():
            print(json.dumps({k: v for k, v in r.items() if k != "metrics"}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    if not table(results, a):
        sys.exit(1)


if __name__ == "__main__":
    main()
