"""`experiments/bench/extend_call.py --smoke` (CPU, the multi-turn bench's tiny model) times one
observation call with and without its paged read, at two blocks, and prints a row of each."""
import os
import re
import subprocess
import sys

from tests.xla_env import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_extend_call_bench_smoke():
    env = one_device_env()
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "extend_call.py"),
           "--smoke", "--blocks", "64,8", "--histories", "300", "--repeats", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in p.stdout.splitlines()
            if re.match(r"\| 16 \|", line)]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("no (first=True)", "-", "0"), ("yes", "64", "300"), ("yes", "8", "300")]
    assert all(float(r[4]) > 0 for r in rows)
