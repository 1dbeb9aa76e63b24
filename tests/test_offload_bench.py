"""`experiments/bench/offload.py --smoke` (CPU, tiny shapes): bf16 masters, fp32 on the device
and fp32 offloaded (also with the layers' gradients added into the accumulator in the backward)
each take their steps in their own process and print a row; fp32 masters move at lr 1e-6
where bf16 ones mostly do not, and the fp32 cases reach the same loss."""
import json
import os
import subprocess
import sys

from tests.xla_env import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_offload_bench_smoke(tmp_path):
    env = one_device_env()
    out = tmp_path / "offload.json"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "offload.py"), "--smoke",
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {"bf16", "fp32", "offload", "offload+sink"}
    assert not any("error" in r for r in recs.values()), recs
    assert all(recs[k]["moved"] > 0.9 for k in ("fp32", "offload", "offload+sink"))
    assert recs["bf16"]["moved"] < 0.5
    assert abs(recs["fp32"]["loss"] - recs["offload"]["loss"]) < 1e-4
    assert abs(recs["offload+sink"]["loss"] - recs["offload"]["loss"]) < 1e-4
    rows = [line for line in p.stdout.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 4 and all(len(r.split("|")) == 14 for r in rows), rows
