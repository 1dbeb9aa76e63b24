"""The run a user writes, timed as a user runs it: `python -m lrl.main --config=configs/default.py`
at Qwen2.5-1.5B shapes (random weights, the synthetic arithmetic prompts, answers that end by
themselves), each run a separate process, as a rerun or a resume is.

    python experiments/bench/startup.py --out /tmp/startup            # H200: every run below
    python experiments/bench/startup.py --runs first,second --steps 2
    python experiments/bench/startup.py --smoke                        # CPU, tiny shapes

Runs (all share one compile cache, `<out>/.lrl-cache`, which `first` starts empty):
- `first`, `second`: the same command twice in fresh workdirs: the second start finds the
  compiled programs and the update's micro-batch budget on disk (`lrl.compile_cache`).
- `sync`, `partial`: `--steps` steps synchronous, then with `--config.rollout.partial=True`
  alone (its default tail cut): what the switch does to a step. `partial-s256` (or `sync-sN`):
  the same with `rollout.max_slots=256`.
The table: wall seconds of the process, step 1's seconds (compiles and the budget search
included), programs loaded from the cache, C++ log lines (`E1204 ...`, `W1204 ...`) that
reached the console, and from step 3 on the mean step, rollout, slot occupancy, samples carried,
groups dropped as stale, trained tokens a second and whole-step MFU
(`grpo_step.flops_and_prediction`'s FLOP count over --peak-tflops).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# This folder off the path: its profile.py would shadow the standard library's, which
# transformers imports (the table's tokenizer failed so on the H200, 2026-12-05).
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

# Issue 39's user: Qwen2.5-1.5B shapes on the embedded default, 64 prompts x 8, answers to 8K.
# The vocabulary stays the embedded tokenizer's (300): random weights then draw the end token
# about once in 300 tokens (answers of ~300, a tail to 2-3K), as the user saw. Padded to
# Qwen's 151,936 ids they almost never draw it, and every answer runs to the 8,192 cap.
QWEN_1_5B = dict(d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                 mlp_dim=8960, rope_theta=1e6, dtype="bfloat16", remat="dots_attn")
RL = dict(prompts_per_step=64, group_size=8, max_new_tokens=8192, row_len=0,
          max_tokens_per_micro=0, minibatches=4)
SMOKE_MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)
SMOKE_RL = dict(prompts_per_step=2, group_size=4, max_new_tokens=16, row_len=256,
                max_tokens_per_micro=1024, minibatches=1)
# The C++ runtime's log lines: severity letter, month and day, time, thread, file:line.
CPP_LINE = re.compile(r"^[EWF]\d{4} \d\d:\d\d:\d\d")


def overrides(smoke: bool) -> dict:
    model, rl = (SMOKE_MODEL, SMOKE_RL) if smoke else (QWEN_1_5B, RL)
    o = {f"model.{k}": v for k, v in model.items()}
    o.update({f"rl.{k}": v for k, v in rl.items()})
    o.update({"sft.steps": 0, "eval.every": 0, "checkpoint.every_steps": 1000})
    return o


def command(workdir: str, steps: int, extra: dict, smoke: bool) -> list[str]:
    o = {**overrides(smoke), "rl.steps": steps, **extra}
    return ([sys.executable, "-m", "lrl.main", "--config=configs/default.py",
             f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in o.items()])


def run_one(name: str, out: str, steps: int, extra: dict, smoke: bool, timeout: float) -> dict:
    workdir = os.path.join(out, name)
    log = os.path.join(out, f"{name}.log")
    subprocess.run(["rm", "-rf", workdir])   # a fresh start, not a resume
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(command(workdir, steps, extra, smoke), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"   # the steps it finished are in its metrics.jsonl
    wall = time.time() - t0
    console = open(log).read().splitlines()
    rows = []
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
        rows = [r for r in map(json.loads, open(path)) if "pack/tokens" in r]
        subprocess.run(["cp", path, os.path.join(out, f"{name}.metrics.jsonl")])
    print(f"{name}: exit {rc}, {wall:.0f} s, {len(rows)} steps (log {log})", flush=True)
    return dict(name=name, rc=rc, wall=wall, rows=rows, workdir=workdir,
                cpp_lines=sum(bool(CPP_LINE.match(x)) for x in console),
                # where the start's time went: the budget's note, the set-up's and step 1's compiles
                profile=[x.strip() for x in console if "update micro-batch:" in x] + [
                    f"{what}: " + ", ".join(f"{k.split('/', 1)[1]} {v:.1f} s"
                                            for k, v in rows[0].items() if k.startswith(key))
                    for what, key in (("the set-up's costliest compiles (the search's window)",
                                       "setup_compile_s/"),
                                      ("step 1's costliest compiles", "compile_s/"))
                    if rows],
                tail=console[-5:] if rc else [])


def mfu(row: dict, cfg, a) -> float:
    import importlib.util
    spec = importlib.util.spec_from_file_location("grpo_step", os.path.join(HERE, "grpo_step.py"))
    grpo_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo_step)
    flops_and_prediction = grpo_step.flops_and_prediction
    ns = SimpleNamespace(prompts=a.prompts, group=a.group, slots=a.slots,
                         peak_tflops=a.peak_tflops, decode_frac=0.5, hbm_tbs=4.1,
                         prefill_mfu=0.74, update_mfu=0.6)
    flops, _, _ = flops_and_prediction(row, cfg, ns)
    return flops / (row["time/step_s"] * a.peak_tflops * 1e12)


def model_config(res: dict, smoke: bool):
    """The policy's ModelConfig as the run built it (its tokenizer is in the workdir)."""
    from lrl import build
    from lrl.tasks import text
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import default
    c = default.get_config()
    for k, v in overrides(smoke).items():
        section, key = k.split(".")
        c[section][key] = v
    opts = build.options(c, check_files=False)
    return text.model_config(opts, text.build_tokenizer(opts, res["workdir"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/lrl-bench-startup")
    ap.add_argument("--runs", default="first,second,sync,partial")
    ap.add_argument("--start-steps", type=int, default=2, help="steps of first and second")
    ap.add_argument("--steps", type=int, default=8, help="steps of sync and partial")
    ap.add_argument("--peak-tflops", type=float, default=791.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a run may take")
    a = ap.parse_args()
    a.prompts = (SMOKE_RL if a.smoke else RL)["prompts_per_step"]
    a.group = (SMOKE_RL if a.smoke else RL)["group_size"]
    from lrl.options import AUTO_SLOTS   # rollout.max_slots=0: the step's samples, at most
    a.slots = min(a.prompts * a.group, AUTO_SLOTS)
    os.makedirs(a.out, exist_ok=True)
    cache = os.path.join(a.out, ".lrl-cache")
    runs = a.runs.split(",")
    if "first" in runs:
        subprocess.run(["rm", "-rf", cache])
    plan = {"first": (a.start_steps, {}), "second": (a.start_steps, {}),
            "sync": (a.steps, {}), "partial": (a.steps, {"rollout.partial": True})}
    for n in runs:   # `partial-s256`: the partial run with rollout.max_slots=256
        base, _, slots = n.partition("-s")
        if n not in plan and base in ("sync", "partial") and slots.isdigit():
            plan[n] = (a.steps, {**plan[base][1], "rollout.max_slots": int(slots)})
        elif n not in plan:
            ap.error(f"--runs: unknown run {n!r} (first, second, sync, partial, sync-sN, "
                     "partial-sN)")
    results = [run_one(n, a.out, plan[n][0], {"compile_cache": cache, **plan[n][1]}, a.smoke,
                       a.timeout)
               for n in runs]
    cfg = next((model_config(r, a.smoke) for r in results if r["rows"]), None)
    print("\n| run | exit | wall s | step 1 s | loaded from cache | C++ lines on console | "
          "steps 3+: step s | rollout s | occupancy | carried | dropped stale groups | "
          "trained tok/s | MFU |")
    print("|" + "---|" * 13)
    for r in results:
        rows, later = r["rows"], r["rows"][2:]
        first = rows[0] if rows else {}
        mean = lambda k: (sum(x.get(k, float("nan")) for x in later) / len(later)  # noqa: E731
                          if later else float("nan"))
        m = (sum(mfu(x, cfg, a) for x in later) / len(later)) if later else float("nan")
        # MFU counts every sampled token, also those of groups dropped later as stale: the
        # trained tokens a second say what the step delivers.
        trained = (sum(x["pack/tokens"] for x in later) / sum(x["time/step_s"] for x in later)
                   if later else float("nan"))
        print(f"| {r['name']} | {r['rc']} | {r['wall']:.0f} | "
              f"{first.get('time/step_s', float('nan')):.1f} | "
              f"{rows[-1].get('compile_cache/loaded', 0) if rows else 0:.0f} | "
              f"{r['cpp_lines']} | {mean('time/step_s'):.2f} | {mean('time/rollout_s'):.2f} | "
              f"{mean('rollout/occupancy'):.0%} | {mean('partial/carried_samples'):.0f} | "
              f"{mean('partial/dropped_stale_groups'):.1f} | {trained:,.0f} | {m:.1%} |")
        for line in r["tail"]:
            print(f"    {line}")
    print("\nStep 1, where the time went: | run | step 1 s | before step 1 s | compile or load s "
          "| rollout s | warm-up s | log-prob s | update s |")
    for r in results:
        f = r["rows"][0] if r["rows"] else {}
        before = r["wall"] - sum(x.get("time/step_s", 0.0) for x in r["rows"])
        print(f"| {r['name']} | " + " | ".join(f"{v:.1f}" for v in (
            f.get("time/step_s", float("nan")), before, f.get("compiles/seconds", float("nan")),
            f.get("time/rollout_s", float("nan")), f.get("time/warm_up_s", float("nan")),
            f.get("time/logprob_s", float("nan")), f.get("time/update_s", float("nan")))) + " |")
        for line in r["profile"]:
            print(f"    {line}")


if __name__ == "__main__":
    main()
