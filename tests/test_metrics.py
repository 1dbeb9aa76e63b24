"""Metrics files across a crash and a resume: the jsonl logs cut back to the restored step,
TensorBoard told to purge the repeated steps, curves drawn from the whole file."""
import io
import json
import os
import struct
import time

import pytest

from lrl import metrics as metrics_lib


def _rows(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


def _first_run(workdir, last_step, tensorboard=False):
    """SFT steps 1-3, the GRPO baseline eval at 3, GRPO steps 4..last_step with samples; then
    the process dies without closing anything (kill -9): only flushed rows are on disk."""
    w = metrics_lib.MetricsWriter(str(workdir), last_step, tensorboard=tensorboard,
                                  stream=io.StringIO())
    for s in (1, 2, 3):
        w.write(s, {"loss": 5.0 - s}, phase="sft")
    w.write(3, {"eval/reward/mean": 0.3})
    for s in range(4, last_step + 1):
        w.write(s, {"loss": 1.0 / s, "reward/mean": 0.1 * s, "response/length_mean": 10 + s})
        w.samples(s, [{"completion": f"c{s}", "reward": 0.0}])
    return w


def test_resume_cuts_the_logs_back_to_the_restored_step(tmp_path):
    _first_run(tmp_path, 8)
    # A torn last line: the process died in the middle of a write.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "phase": "grp')
    w = metrics_lib.MetricsWriter(str(tmp_path), 10, tensorboard=False, stream=io.StringIO())
    dropped = w.resume(5, "grpo")  # the newest checkpoint is step 5
    assert dropped == {"metrics.jsonl": 4, "samples.jsonl": 3}
    for s in range(6, 11):
        w.write(s, {"loss": 1.0, "reward/mean": 0.5})
        w.samples(s, [{"completion": "again", "reward": 1.0}])
    w.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["phase"]) for r in rows] == [
        (1, "sft"), (2, "sft"), (3, "sft"), (3, "grpo")] + [(s, "grpo") for s in range(4, 11)]
    assert [r["loss"] for r in rows[4:6]] == [0.25, 0.2]  # steps 4, 5 of the first run kept
    assert [r["step"] for r in _rows(tmp_path / "samples.jsonl")] == list(range(4, 11))
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_resume_from_the_sft_checkpoint_drops_the_grpo_baseline_at_its_step(tmp_path):
    _first_run(tmp_path, 5)
    w = metrics_lib.MetricsWriter(str(tmp_path), 5, tensorboard=False, stream=io.StringIO())
    # The SFT phase's last checkpoint (step 3): GRPO will evaluate its baseline at 3 again.
    assert w.resume(3, "sft") == {"metrics.jsonl": 3, "samples.jsonl": 2}
    w.close()
    assert [(r["step"], r["phase"]) for r in _rows(tmp_path / "metrics.jsonl")] == [
        (1, "sft"), (2, "sft"), (3, "sft")]
    # No checkpoint at all: the run starts over and every row will be written again.
    w = metrics_lib.MetricsWriter(str(tmp_path), 5, tensorboard=False, stream=io.StringIO())
    assert w.resume(0) == {"metrics.jsonl": 3, "samples.jsonl": 0}
    w.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resume_after_the_first_write_is_refused(tmp_path):
    w = metrics_lib.MetricsWriter(str(tmp_path), 3, tensorboard=False, stream=io.StringIO())
    w.write(1, {"loss": 1.0})
    with pytest.raises(RuntimeError, match="before the first write"):
        w.resume(0)
    w.close()


def _events(path):
    """The Event protos of one TensorBoard events file (TFRecord framing)."""
    from tensorboardX.proto import event_pb2
    out, data = [], open(path, "rb").read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
        i += 12 + n + 4
    return out


def test_tensorboard_purges_the_steps_after_the_restored_one(tmp_path):
    _first_run(tmp_path, 8, tensorboard=True)
    first = os.listdir(tmp_path / "tb")
    time.sleep(1.1)  # events files are named by the second they were opened in
    w = metrics_lib.MetricsWriter(str(tmp_path), 10, tensorboard=True, stream=io.StringIO())
    w.resume(5, "grpo")
    w.write(6, {"loss": 1.0})
    w.close()
    new = [f for f in os.listdir(tmp_path / "tb") if f not in first]
    assert len(new) == 1  # one events file per process start, none opened before resume
    events = _events(tmp_path / "tb" / new[0])
    # TensorBoard hides every event of the older files at steps >= 6 when it reads a
    # SessionLog START at step 6 (tensorboardX's purge_step).
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == [6]
    assert [e.step for e in events if e.HasField("summary")] == [6, 6]  # loss, time/step_s


def test_curves_are_drawn_from_the_whole_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    _first_run(tmp_path, 8)
    w = metrics_lib.MetricsWriter(str(tmp_path), 10, tensorboard=False, stream=io.StringIO())
    w.resume(5, "grpo")
    for s in (6, 7):
        w.write(s, {"reward/mean": 0.5, "response/length_mean": 12})
    drawn = []
    plot = Axes.plot

    def record(self, *args, **kwargs):
        if kwargs.get("label") == "train":
            drawn.append(list(args[0]))
        return plot(self, *args, **kwargs)
    monkeypatch.setattr(Axes, "plot", record)
    assert w.plot("grpo").endswith("grpo_curves.png")
    w.close()
    # Reward and length, steps 4-5 of the first run and 6-7 of this one, each once.
    assert drawn == [[4, 5, 6, 7], [4, 5, 6, 7]]


def test_set_up_measurements_go_into_the_next_row_alone(tmp_path):
    """A phase's set-up (its compiles, timed before any step) is recorded with its first step,
    whose time includes it; the step's own keys win, and the row after carries nothing."""
    w = metrics_lib.MetricsWriter(str(tmp_path), 3, tensorboard=False, stream=io.StringIO())
    w.with_next({"setup_compile_s/decode_steps": 2.5, "loss": -1.0})
    w.write(1, {"loss": 0.5})
    w.write(2, {"loss": 0.25})
    w.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert rows[0]["setup_compile_s/decode_steps"] == 2.5 and rows[0]["loss"] == 0.5
    assert "setup_compile_s/decode_steps" not in rows[1]
