"""PPO (configs/default.py:ppo) against GRPO (configs/default.py) on the embedded default, on
CPU, in the same wall time. One SFT warm start (the default's 300 steps, run once under
WORKDIR/sft and copied to every arm's checkpoints, from which each resumes), then N steps of
every arm, **all arms at once** (one niced subprocess each), so that on a shared machine they
see the same load. Each step's wall and CPU seconds of training (rollout, rewards, update; the
held-out evals excluded) are added to its metrics as `bench/train_wall_s` and
`bench/train_cpu_s`, cumulative, so the held-out reward can be read against the time spent
(docs/ppo.md).

An arm is `NAME=CONFIG_ARG` and optional `key=value` overrides, space-separated:

    nice -n 5 python experiments/bench/ppo_vs_grpo_cpu.py --steps 30 --every 10 \\
        --workdir /tmp/ppo-vs-grpo --arm grpo= --arm ppo=ppo
    nice -n 5 python experiments/bench/ppo_vs_grpo_cpu.py --steps 12 --every 6 \\
        --arm grpo= --arm "ppo_e1=ppo critic.ppo_epochs=1 rl.lam=0.95"

`--table` prints the table of a finished workdir's arms again without running anything.
"""
import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "configs", "default.py")


def parse_arm(spec: str):
    """`"name=arg k=v k=v"` -> (name, arg or None, {dotted key: value})."""
    head, *sets = spec.split()
    if "=" not in head:
        raise ValueError(f"--arm {spec!r}: the first word must be NAME=CONFIG_ARG (grpo=)")
    name, arg = head.split("=", 1)
    overrides = {}
    for kv in sets:
        if "=" not in kv:
            raise ValueError(f"--arm {spec!r}: override {kv!r} is not key=value")
        k, v = kv.split("=", 1)
        try:
            overrides[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            overrides[k] = v
    return name, arg or None, overrides


def config(arg, overrides, steps, every):
    from lrl import config_util
    c = config_util.load(CONFIG, arg)
    for k, v in overrides.items():
        *path, leaf = k.split(".")
        node = c
        for p in path:
            node = node[p]
        if leaf not in node:
            raise KeyError(f"override {k}: no such config field")
        node[leaf] = v
    c.rl.steps = steps
    c.eval.every = every
    c.metrics.tensorboard = False
    c.checkpoint.keep = 10   # the SFT's last step stays in sft/, for the arms to start from
    return c


def run(c, workdir):
    """loop.run with grpo.step timed: cumulative training seconds in every step's metrics."""
    from lrl import grpo, loop
    spent = {"wall": 0.0, "cpu": 0.0}
    step = grpo.step

    def timed(*a, **k):
        t, cpu = time.time(), time.process_time()
        out = step(*a, **k)
        spent["wall"] += time.time() - t
        spent["cpu"] += time.process_time() - cpu
        out[1].update({"bench/train_wall_s": spent["wall"], "bench/train_cpu_s": spent["cpu"]})
        return out

    loop.run(c, workdir, step=timed)


def evals(workdir):
    rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    return [(r["step"], r.get("bench/train_wall_s", 0.0), r.get("bench/train_cpu_s", 0.0),
             r["eval/reward/mean"], r.get("eval/pass@4")) for r in rows
            if "eval/reward/mean" in r]


def table(workdir, names):
    print("| run | step | train wall s | train CPU s | held-out reward | pass@4 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        for step, wall, cpu, reward, p4 in evals(os.path.join(workdir, name)):
            print(f"| {name} | {step} | {wall:.0f} | {cpu:.0f} | {reward:.3f} | "
                  f"{p4 if p4 is None else round(p4, 3)} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--workdir", default="/tmp/ppo-vs-grpo")
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME=CONFIG_ARG [key=value ...]; default: grpo= and ppo=ppo")
    ap.add_argument("--nice", type=int, default=5, help="niceness of each arm's process")
    ap.add_argument("--table", action="store_true", help="print the table of a finished run")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # an arm's own process
    a = ap.parse_args()
    arms = [parse_arm(s) for s in (a.arm or ["grpo=", "ppo=ppo"])]
    names = [n for n, _, _ in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"--arm names repeat: {names}")
    if a.one:
        name, arg, overrides = parse_arm(a.one)
        return run(config(arg, overrides, a.steps, a.every), os.path.join(a.workdir, name))
    if a.table:
        return table(a.workdir, names)
    sft_steps = config(None, {}, 0, 0).sft.steps
    sft = os.path.join(a.workdir, "sft")
    if not os.path.isdir(os.path.join(sft, "checkpoints", str(sft_steps))):
        run(config(None, {}, 0, 0), sft)   # rl.steps=0: the warm start alone
    procs = []
    for spec, (name, _, _) in zip(a.arm or ["grpo=", "ppo=ppo"], arms):
        d = os.path.join(a.workdir, name)
        shutil.rmtree(d, ignore_errors=True)
        for item in (str(sft_steps), "tokenizer"):  # the tokenizer the SFT trained
            if os.path.isdir(os.path.join(sft, "checkpoints", item)):
                shutil.copytree(os.path.join(sft, "checkpoints", item),
                                os.path.join(d, "checkpoints", item))
        log = open(os.path.join(a.workdir, f"{name}.log"), "w")
        procs.append(subprocess.Popen(
            ["nice", "-n", str(a.nice), sys.executable, os.path.abspath(__file__),
             "--one", spec, "--steps", str(a.steps), "--every", str(a.every),
             "--workdir", a.workdir], stdout=log, stderr=subprocess.STDOUT))
    failed = [n for n, p in zip(names, procs) if p.wait()]
    if failed:
        raise SystemExit(f"arms failed: {failed} (their logs: {a.workdir}/<name>.log)")
    table(a.workdir, names)


if __name__ == "__main__":
    main()
