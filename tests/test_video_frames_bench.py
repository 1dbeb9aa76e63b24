"""`experiments/bench/video_frames.py --small` (CPU, tiny shapes) runs both prefill paths and
both update layouts for G=2 answers, and exits 0 only when the layouts agree on the loss and the
gradient norm (fp32, rtol 1e-5)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.optimized
def test_video_frames_small_with_the_shared_prompt():
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "video_frames.py"),
           "--small", "--frames", "8", "--seq", "1", "--answers", "2",
           "--shared-prompt", "off,on", "--prefill", "chunked,whole"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = [x for x in out.stdout.splitlines() if x.startswith("| 8 |")]
    assert len(table) == 1, out.stdout
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert cells[5] and cells[6]                      # chunked and whole prefill timed
    assert "agree across layouts within rtol 1e-05: True" in out.stdout
