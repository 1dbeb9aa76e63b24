"""`experiments/bench/grpo_step.py --smoke` (CPU, tiny shapes, one device) runs three GRPO steps
through `lrl.loop.run` for the text case and for the two real-model configs' rows
(`--case video_qa`, `--case long_context_ring`) and PPO's step (`--estimator gae`), prints a table of three step rows with finite
numbers, and compiles nothing after the first step."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.xla_env import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"text": [], "video_qa": ["--case", "video_qa"],
         "long_context_ring": ["--case", "long_context_ring"],
         "gae": ["--estimator", "gae"]}   # PPO's step: a critic beside the actor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three smoke runs, side by side (each its own process and workdir)."""
    env = one_device_env()
    procs = {}
    for name, args in CASES.items():
        d = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "grpo_step.py"),
               "--smoke", *args, "--workdir", str(d / "run"), "--json", str(d / "rows.json")]
        procs[name] = (d, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, env=env, cwd=ROOT))
    out = {}
    for name, (d, p) in procs.items():
        stdout, stderr = p.communicate(timeout=400)
        assert p.returncode == 0, f"{name}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        metrics = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        out[name] = dict(stdout=stdout, rows=json.loads((d / "rows.json").read_text())["rows"],
                         steps=[r for r in metrics if "compiles/step" in r])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_three_step_rows_of_finite_numbers(runs, case):
    r = runs[case]
    lines = [x for x in r["stdout"].splitlines() if re.match(r"\| \d+ \|", x)]
    assert [x.split("|")[1].strip() for x in lines] == ["1", "2", "3"], r["stdout"][-3000:]
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 21 and all(re.search(r"\d", c) for c in cells), line
        assert not re.search(r"nan|inf", line, re.IGNORECASE), line
    assert len(r["rows"]) == 3
    for row in r["rows"]:
        for k in ("step_s", "rollout_s", "update_s", "tok_s_gpu", "mfu", "composition",
                  "composition_roofline"):
            assert math.isfinite(row[k]) and row[k] >= 0, (k, row)
        assert row["generated"] > 0 and row["trained"] > 0
    if case == "video_qa":   # the rows held each group's video prompt once (shared, auto)
        assert all(s["pack/shared_frac"] == 1.0 for s in r["steps"])
        assert all(s["vision/encoded_items"] == 4 for s in r["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_nothing_compiles_after_the_first_step(runs, case):
    """The video case too: its prompts' embeddings are computed for length buckets and the
    engine's multimodal prefill rows are written by one program (`engine.embed_rows`), so a
    new question length compiles nothing."""
    steps = runs[case]["steps"]
    assert len(steps) == 3
    assert [s["compiles/step"] for s in steps[1:]] == [0, 0], steps


def test_the_step_timeline_reads_busy_time_and_gaps_from_a_gpu_trace(tmp_path):
    """`profile.timeline` (grpo_step.py --profile-step) on a GPU trace as jax 0.11 writes it:
    kernels on stream lines, each naming its XLA module; busy is their union (streams
    overlap), idle gaps are summed by the programs either side."""
    import gzip
    sys.path.insert(0, ROOT)
    from experiments.bench.profile import timeline
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1,
             "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2,
             "args": {"name": "Stream #16(MemcpyD2H)"}}]

    def kernel(ts, dur, module, tid=1):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": "k",
                "args": {"hlo_module": module}}
    events = [kernel(0, 1000, "jit_decode_steps(3)"), kernel(900, 200, "MemcpyD2H", tid=2),
              kernel(1500, 500, "jit_insert_slots(7)"), kernel(2500, 500, "jit_decode_steps(3)")]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    text = timeline(str(tmp_path))
    assert text.startswith("span 3.0 ms: device busy 2.1 ms (70.0%), idle 0.9 ms"), text
    assert "| jit_decode_steps | 2 | 1.5 | 0.750 |" in text
    assert "| MemcpyD2H -> jit_insert_slots | 1 | 0.4 | 0.400 |" in text
    assert "| jit_insert_slots -> jit_decode_steps | 1 | 0.5 | 0.500 |" in text
