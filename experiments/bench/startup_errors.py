"""Time from the command to the first error, per kind of bad input, on CPU: each row of
tests/test_preflight.py's table as a real `python -m lrl.main` command line (one CPU device),
timed with the interpreter's start-up and imports included. The table in
docs/troubleshooting.md is its output.

    python experiments/bench/startup_errors.py [--old=DIR]   # DIR: another lrl checkout,
                                                              # timed on the same commands
"""
import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Not this folder: its profile.py would shadow the standard library's (torch imports it).
sys.path[0] = ROOT


def flags(files, over):
    base = {"data.source": "jsonl", "data.paths": files["train"],
            "data.eval_paths": files["test"], "tokenizer.path": files["tok"],
            "model.hf_path": files["hf"], "sft.steps": 2, "sft.paths": files["sft"],
            "reward.spec": "math:1.0", "eval.every": 3, "eval.num_prompts": 8,
            "metrics.tensorboard": False}
    for k, v in over.items():
        base[k] = files[v[1:]] if isinstance(v, str) and v.startswith("@") else v
    return [f"--config.{k}={v}" for k, v in base.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="", help="another checkout to time the same commands in")
    ap.add_argument("--only", default="", help="comma-separated row names")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tests import test_preflight as T   # the table and its fixture files

    class Factory:
        def mktemp(self, name):
            path = tempfile.mkdtemp(prefix=f"lrl-{name}-")
            import pathlib
            return pathlib.Path(path)
    files = T.files.__wrapped__(Factory())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    only = set(filter(None, args.only.split(",")))
    print("| bad input | seconds to the error (CPU seconds) | exit | message (start) |")
    print("| --- | --- | --- | --- |")
    for name, over, _ in T.CASES:
        if (only and name not in only) or "rl.prompts_per_step" in over:
            continue   # (one CPU device: every prompt count divides over it)
        for where in filter(None, (ROOT, args.old)):
            cmd = [sys.executable, "-m", "lrl.main", "--config=configs/default.py:runlocal",
                   f"--workdir={tempfile.mkdtemp()}", *flags(files, over)]
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            out = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True,
                                 timeout=1800)
            took = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            last = [x for x in out.stderr.splitlines() if x.strip()]
            line = next((x for x in last if "error:" in x), last[-1] if last else "")
            tag = "" if where == ROOT else " (old)"
            print(f"| {name}{tag} | {took:.1f} ({cpu:.1f}) | {out.returncode} | "
                  f"{line.replace('|', '/')[:110]} |", flush=True)


if __name__ == "__main__":
    main()
