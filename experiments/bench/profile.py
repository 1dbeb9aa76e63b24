"""Where a step's time goes: a JAX profiler trace of the update step or of decoding, summed
per XLA module, per op and per op kind, printed as markdown tables.

    python experiments/bench/profile.py --what train --length 16384 --out /tmp/prof   # H200
    python experiments/bench/profile.py --what decode --slots 256 --prompt 512 --new 64
    python experiments/bench/profile.py --smoke --what train    # CPU, tiny, checks the script

The trace is what `jax.profiler` writes (`plugins/profile/*/…trace.json.gz`); the device's
op lines are summed by op name, and the op names are classed by the fused HLO they run
(matmul, attention custom call, reduction, elementwise, copy/transpose, collective), read
from the compiled module's HLO text written next to the trace. Ablations time the parts of
the update step alone (forward log-probs, AdamW) so the op table can be checked against them.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ----------------------------------------------------------------------------- trace parsing

def load_trace(log_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(files[-1]) as f:
        return json.load(f)


def device_lines(trace: dict) -> dict:
    """{(process name, thread name): [events]} for complete events ('X')."""
    pname, tname = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    lines = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "dur" in e:
            lines[(pname.get(e["pid"], str(e["pid"])),
                   tname.get((e["pid"], e.get("tid")), str(e.get("tid"))))].append(e)
    return lines


_KINDS = (("attention", r"cudnn|fmha|flash|paged|mosaic"),
          ("matmul", r"\bdot\(|cublas|gemm|convolution"),
          ("pallas kernel", r"triton|pallas"),
          ("collective", r"all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"),
          ("reduction", r"\breduce\(|reduce-window"),
          ("copy/transpose", r"\bcopy\(|transpose\(|dynamic-update-slice|\bconcatenate\("),
          ("elementwise", r"."))


def op_kinds(hlo_text: str) -> dict:
    """{op or fusion name: kind}, from the fused computations each top-level op calls."""
    comps, cur = {}, None
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("{")[0]:
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    body = {k: "\n".join(v) for k, v in comps.items()}
    kinds = {}
    for text in body.values():
        for line in text.splitlines():
            m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
            if not m:
                continue
            name, rhs = m.groups()
            called = re.findall(r"calls=%?([\w.\-]+)", rhs)
            what = rhs + "".join(body.get(c, "") for c in called)
            for kind, pat in _KINDS:
                if re.search(pat, what):
                    # GPU kernels carry the op's name with '.' written '_' (fusion.12 ->
                    # fusion_12) under jax 0.11; keep both spellings.
                    kinds[name] = kinds[name.replace(".", "_")] = kind
                    break
    return kinds


def _kind(kinds: dict, event: dict) -> str:
    """An op event's kind: by the HLO op the profiler names in its args, else by its name."""
    op = str(event.get("args", {}).get("hlo_op", ""))
    return kinds.get(op) or kinds.get(event["name"]) or "?"


def summarize(log_dir: str, hlo_text: str = "", top: int = 25, module: str = "",
              steps: int = 1) -> str:
    """Markdown: busy time per device line, time per XLA module, top ops, time per op kind."""
    lines = device_lines(load_trace(log_dir))
    dev = {k: v for k, v in lines.items() if "/device:" in k[0] and "TPU" not in k[0]}
    if not dev:  # CPU: XLA's ops run on host threads
        dev = {k: v for k, v in lines.items() if re.search(r"XLA|tf_|Thunk|pjrt", k[1], re.I)}
    out = ["| device line | events | busy ms per step |", "|---|---|---|"]
    for (p, t), ev in sorted(dev.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        out.append(f"| {p} / {t} | {len(ev)} | {sum(e['dur'] for e in ev) / 1e3 / steps:.2f} |")
    ops = [e for (p, t), ev in dev.items() if "Ops" in t for e in ev]
    modules = [e for (p, t), ev in dev.items() if "Modules" in t for e in ev]
    kernels = [e for (p, t), ev in dev.items() if "Stream" in t for e in ev]
    if not ops:
        ops = kernels or [e for ev in dev.values() for e in ev]
    if module:  # ops carry their module's name where the profiler records it
        mine = [e for e in ops if re.search(module, str(e.get("args", {}).get("hlo_module", "")))]
        ops = mine or ops
    if modules:
        out += ["", "| XLA module | calls | ms per step |", "|---|---|---|"]
        per = collections.Counter()
        n = collections.Counter()
        for e in modules:
            per[e["name"]] += e["dur"]
            n[e["name"]] += 1
        for name, d in per.most_common(10):
            out.append(f"| {name[:70]} | {n[name]} | {d / 1e3 / steps:.2f} |")
    kinds = op_kinds(hlo_text) if hlo_text else {}
    total = sum(e["dur"] for e in ops) or 1
    per, n, kind_of = collections.Counter(), collections.Counter(), {}
    for e in ops:
        per[e["name"]] += e["dur"]
        n[e["name"]] += 1
        if kind_of.get(e["name"], "?") == "?":
            kind_of[e["name"]] = _kind(kinds, e)
    out += ["", "| op | kind | calls per step | ms per step | share |", "|---|---|---|---|---|"]
    for name, d in per.most_common(top):
        out.append(f"| {name[:60]} | {kind_of[name]} | {n[name] / steps:.0f} | "
                   f"{d / 1e3 / steps:.2f} | {d / total:.1%} |")
    # Families: a name less its numeric suffixes (fusion.12, input_scatter_fusion_7), so the
    # per-layer copies of one op add up and a per-call time can be read off.
    fam, fam_n = collections.Counter(), collections.Counter()
    for name, d in per.items():
        f = re.sub(r"([._]\d+)+$", "", name)
        fam[f] += d
        fam_n[f] += n[name]
    out += ["", "| op family | calls per step | µs per call | ms per step | share |",
            "|---|---|---|---|---|"]
    for f, d in fam.most_common(top):
        out.append(f"| {f[:60]} | {fam_n[f] / steps:.0f} | {d / fam_n[f]:.1f} | "
                   f"{d / 1e3 / steps:.3f} | {d / total:.1%} |")
    by_kind = collections.Counter()
    for name, d in per.items():
        by_kind[kind_of[name]] += d
    out += ["", "| op kind | ms per step | share |", "|---|---|---|"]
    for k, d in by_kind.most_common():
        out.append(f"| {k} | {d / 1e3 / steps:.2f} | {d / total:.1%} |")
    if kernels and ops is not kernels:
        per_k = collections.Counter()
        for e in kernels:
            per_k[e["name"]] += e["dur"]
        out += ["", "| GPU kernel | ms per step |", "|---|---|"]
        for name, d in per_k.most_common(15):
            out.append(f"| {name[:90]} | {d / 1e3 / steps:.2f} |")
    return "\n".join(out)


def _module(name: str) -> str:
    """An XLA module event's program: its name less the run's numbering (`jit_f(12)`)."""
    return re.sub(r"\(\d+\)$", "", name)


def timeline(log_dir: str, top: int = 12) -> str:
    """Markdown: how a traced span of a run (a whole GRPO step, say) used the device. The
    span runs from the first device event to the last; busy is the union of the XLA modules'
    executions on the device, idle the rest; time per program (calls, ms, ms a call), and the
    idle gaps summed by the programs either side of them, the largest first (what the device
    waited for between which calls)."""
    lines = device_lines(load_trace(log_dir))
    dev = {k: v for k, v in lines.items() if re.search(r"/device:|GPU", k[0])
           and "TPU" not in k[0] and "CPU" not in k[0]}
    listing = "device lines: " + "; ".join(f"{p} / {t}: {len(v)}" for (p, t), v in
                                           sorted(dev.items()))
    # Whole programs where the profiler draws them; else their kernels, named by the module
    # each ran in (a GPU kernel event's args name its HLO module).
    mods = [e for (p, t), v in dev.items() if "Modules" in t for e in v]
    if not mods:
        mods = [dict(e, name=str(e.get("args", {}).get("hlo_module") or e["name"]))
                for (p, t), v in dev.items() if "Ops" in t or "Stream" in t for e in v]
    mods.sort(key=lambda e: e["ts"])
    if not mods:
        return "(no XLA module or kernel events on a device line in the trace)\n" + listing
    span = max(e["ts"] + e["dur"] for e in mods) - mods[0]["ts"]
    busy, gaps, end, prev = 0.0, collections.Counter(), mods[0]["ts"], None
    gap_n = collections.Counter()
    for e in mods:
        if e["ts"] > end and prev is not None:
            key = (_module(prev["name"]), _module(e["name"]))
            gaps[key] += e["ts"] - end
            gap_n[key] += 1
        start = max(e["ts"], end)
        busy += max(0.0, e["ts"] + e["dur"] - start)
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    out = [f"span {span / 1e3:.1f} ms: device busy {busy / 1e3:.1f} ms ({busy / span:.1%}), "
           f"idle {(span - busy) / 1e3:.1f} ms", "",
           "| program | calls | ms | ms a call | share of span |", "|---|---|---|---|---|"]
    per, n = collections.Counter(), collections.Counter()
    for e in mods:
        per[_module(e["name"])] += e["dur"]
        n[_module(e["name"])] += 1
    for name, d in per.most_common(top):
        out.append(f"| {name[:60]} | {n[name]} | {d / 1e3:.1f} | {d / 1e3 / n[name]:.3f} | "
                   f"{d / span:.1%} |")
    out += ["", "| idle gap after -> before | gaps | ms | ms a gap |", "|---|---|---|---|"]
    for (a, b), d in gaps.most_common(top):
        out.append(f"| {a[:40]} -> {b[:40]} | {gap_n[(a, b)]} | {d / 1e3:.1f} | "
                   f"{d / 1e3 / gap_n[(a, b)]:.3f} |")
    return "\n".join(out + ["", listing])


# ----------------------------------------------------------------------------- workloads

def timed(fn, *args, repeats=3):
    import jax
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats


def train(a, out_dir):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from experiments.bench.train_step import qwen25_15b, tiny
    from lrl import mesh as mesh_lib
    from lrl.rl import losses, optim, update

    dtype = jnp.float32 if a.smoke else jnp.bfloat16
    cfg = (tiny if a.smoke else qwen25_15b)(dtype=dtype, param_dtype=jnp.float32, remat=a.remat)
    L = 128 if a.smoke else a.length
    mesh = mesh_lib.make_mesh({"fsdp": -1}, devices=jax.devices()[:1])
    tx = optim.make_optimizer(lr=1e-6, warmup_steps=1, total_steps=100)
    state = update.make_init_fn(cfg, tx, mesh)(jax.random.key(0))
    fn = update.make_update_fn(cfg, losses.LossConfig(), tx, mesh, packed=a.packed)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (1, L), dtype=np.int32)
    batch = {"tokens": tokens, "positions": np.arange(L, dtype=np.int32)[None],
             "segment_ids": np.ones((1, L), np.int32), "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.ones((1, L), np.float32),
             "advantages": rng.standard_normal((1, L)).astype(np.float32)}
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh, 2))
    compiled = fn.lower(state, batch).compile()
    for _ in range(2):
        state, m = compiled(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        state, m = compiled(state, batch)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / a.steps
    jax.profiler.start_trace(os.path.join(out_dir, "trace"))
    for _ in range(a.steps):
        state, m = compiled(state, batch)
    jax.block_until_ready(m)
    jax.profiler.stop_trace()

    # Ablations: the parts alone, each its own program.
    logp = jax.jit(lambda p, b: update.logprobs(p, b, model_cfg=cfg))
    t_fwd = timed(logp, state.params, batch)
    grads = jax.tree.map(jnp.zeros_like, state.params)

    @jax.jit
    def adam(st, g):
        upd, opt = tx.update(g, st.opt_state, st.params)
        return jax.tree.map(lambda p, u: p + u, st.params, upd), opt
    t_adam = timed(adam, state, grads)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    flops = (6 * n_params + 6 * cfg.n_layers * L * cfg.d_model) * L
    rows = [("whole update step", step_s, flops / step_s / 1e12),
            ("forward log-probs only (no grad)", t_fwd, flops / 3 / t_fwd / 1e12),
            ("AdamW + apply alone", t_adam, float("nan"))]
    text = ["| part | ms | TFLOP/s (model count) |", "|---|---|---|"]
    text += [f"| {n} | {t * 1e3:.1f} | {f:.0f} |" for n, t, f in rows]
    return "\n".join(text)


def decode(a, out_dir):
    import jax
    from experiments.bench.rollout import model_config
    from lrl import models, rollout
    import numpy as np

    cfg = model_config(a.smoke)
    params = models.init_params(cfg, jax.random.key(0))
    B, T, n_new = (4, 16, 8) if a.smoke else (a.slots, a.prompt, a.new)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, size=T) for _ in range(B)]
    common = dict(max_new_tokens=n_new, temperature=1.0, seed=0, page_size=a.page_size,
                  max_slots=B, pool_tokens=B * (T + n_new + 2 * a.page_size),
                  steps_per_call=a.steps_per_call, layer_unroll=a.layer_unroll,
                  decode_block_pages=a.decode_block_pages,
                  pallas_k_splits=a.k_splits)
    rollout.generate(cfg, params, prompts, **common)
    stats = {}
    t0 = time.perf_counter()
    rollout.generate(cfg, params, prompts, stats=stats, **common)
    total = time.perf_counter() - t0
    jax.profiler.start_trace(os.path.join(out_dir, "trace"))
    rollout.generate(cfg, params, prompts, **common)
    jax.profiler.stop_trace()
    step_ms = stats["decode_s"] / stats["decode_steps"] * 1e3
    text = ("| slots | prompt | new | total s | decode ms/step | prefill s |\n|---|---|---|---|---|---|"
            f"\n| {B} | {T} | {n_new} | {total:.2f} | {step_ms:.2f} | {stats['prefill_s']:.2f} |")
    return text, stats["decode_steps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", choices=("train", "decode"), default="train")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--remat", default="full")
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps-per-call", type=int, default=32)
    ap.add_argument("--layer-unroll", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--decode-block-pages", type=int, default=4)
    ap.add_argument("--k-splits", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2, help="traced steps (train)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--module", default="", help="regex of the XLA module whose ops to list "
                                                 "(default: update_step / decode_steps)")
    ap.add_argument("--out", default="/tmp/lrl-profile")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dump = os.path.join(a.out, "hlo")
    # Before jax is imported: the optimized HLO of every module, to class the traced ops.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
    module = a.module or ("update_step" if a.what == "train" else "decode_steps")
    if a.what == "train":
        text, steps = train(a, a.out), a.steps
    else:   # the traced run's prefill ops are in the tables too, spread over its steps
        text, steps = decode(a, a.out)
    print(text)
    print()
    hlo = "\n".join(open(f).read() for f in glob.glob(os.path.join(
        dump, f"*{module}*after_optimizations.txt")))
    print(summarize(os.path.join(a.out, "trace"), hlo, a.top, module=module, steps=steps))


def sibling(name: str):
    """A sibling benchmark module of this folder, loaded by path: the folder itself never goes
    on sys.path, where this profile.py would shadow the standard library's."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(
        f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    main()
