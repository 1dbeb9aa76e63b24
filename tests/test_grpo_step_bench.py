"""`experiments/bench/grpo_step.py --smoke` (CPU, tiny shapes, one device) runs three GRPO steps
through `lrl.loop.run` for the text case and for the two real-model configs' rows
(`--case video_qa`, `--case long_context_ring`), prints a table of three step rows with finite
numbers, and compiles nothing after the first step."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"text": [], "video_qa": ["--case", "video_qa"],
         "long_context_ring": ["--case", "long_context_ring"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three smoke runs, side by side (each its own process and workdir)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # One device, as the bench's rows run (the suite's 8 virtual CPU devices are not asked).
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")).strip()
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


@pytest.mark.parametrize("case", list(CASES))
def test_nothing_compiles_after_the_first_step(runs, case):
    """The video case too: its prompts' embeddings are computed for length buckets and the
    engine's multimodal prefill rows are written by one program (`engine.embed_rows`), so a
    new question length compiles nothing."""
    steps = runs[case]["steps"]
    assert len(steps) == 3
    assert [s["compiles/step"] for s in steps[1:]] == [0, 0], steps
