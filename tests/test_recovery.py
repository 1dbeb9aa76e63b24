"""A run broken the ways users break runs, then started again on the same workdir: a death
between checkpoints (no SIGTERM)."""
import json

import pytest

from lrl import checkpoint as ckpt_lib
from lrl import loop
from lrl import metrics as metrics_lib
from tests.test_loop import tiny_config


class Died(Exception):
    """Stands for kill -9 / OOM: the process stops between a step's log and its checkpoint."""


def _steps(path):
    return [json.loads(line)["step"] for line in open(path).read().splitlines()]


def test_death_between_checkpoints_logs_each_step_once(tmp_path, monkeypatch):
    cfg = tiny_config()
    cfg.eval.every = 0
    work = str(tmp_path)
    write = metrics_lib.MetricsWriter.write

    def write_then_die(self, step, metrics, phase="grpo"):
        scalars = write(self, step, metrics, phase)
        if step == 5:  # logged, but the checkpoint of step 5 is never saved
            raise Died()
        return scalars

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_die)
    with pytest.raises(Died):
        loop.run(cfg, work)
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
    assert ckpt_lib.CheckpointManager(tmp_path / "checkpoints").all_steps()[-1] == 4
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]
    loop.run(cfg, work)  # resumes from step 4: step 5 is logged again, once
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert _steps(tmp_path / "samples.jsonl") == sorted(_steps(tmp_path / "samples.jsonl"))
    assert len(set(_steps(tmp_path / "samples.jsonl"))) == 3  # steps 4, 5, 6

