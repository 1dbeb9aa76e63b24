"""PPO (configs/default.py:ppo) against GRPO (configs/default.py) on the embedded default, on
CPU: the same SFT warm start (run once, by the GRPO run, and copied to the PPO run's
checkpoints, from which it resumes), then N steps of each, one after the other. Each step's
wall and CPU seconds of training (rollout, rewards, update; the held-out evals excluded) are
added to its metrics as `bench/train_wall_s` and `bench/train_cpu_s`, cumulative, so the
held-out reward can be read against the time spent (docs/ppo.md).

    nice python experiments/bench/ppo_vs_grpo_cpu.py --steps 40 --workdir /tmp/ppo-vs-grpo
"""
import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def run(arg, workdir, steps, every):
    from lrl import config_util, grpo, loop
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), arg)
    c.rl.steps = steps
    c.eval.every = every
    c.metrics.tensorboard = False
    c.checkpoint.keep = 10   # the SFT's last step stays, for the PPO run to start from
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--workdir", default="/tmp/ppo-vs-grpo")
    ap.add_argument("--only", default="", choices=("", "grpo", "ppo", "table"),
                    help="one half (ppo: after a grpo run in the same workdir), or the table")
    a = ap.parse_args()
    g, p = os.path.join(a.workdir, "grpo"), os.path.join(a.workdir, "ppo")
    if a.only in ("", "grpo"):
        run(None, g, a.steps, a.every)
    if a.only in ("", "ppo"):
        from lrl import config_util
        sft = config_util.load(os.path.join(ROOT, "configs", "default.py")).sft.steps
        os.makedirs(os.path.join(p, "checkpoints"), exist_ok=True)
        shutil.copytree(os.path.join(g, "checkpoints", str(sft)),
                        os.path.join(p, "checkpoints", str(sft)))
        run("ppo", p, a.steps, a.every)
    for name, d in (("grpo", g), ("ppo", p)):
        rows = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
        for r in rows:
            if "eval/reward/mean" in r:
                print(name, r["step"], round(r.get("bench/train_wall_s", 0.0), 1),
                      round(r.get("bench/train_cpu_s", 0.0), 1), r["eval/reward/mean"],
                      r.get("eval/pass@4"))


if __name__ == "__main__":
    main()
