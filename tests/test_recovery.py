"""A run broken the ways users break runs, then started again on the same workdir: a death
between checkpoints (no SIGTERM), then a step directory that lost an item."""
import json
import os
import shutil

import pytest

from lrl import checkpoint as ckpt_lib
from lrl import loop
from lrl import metrics as metrics_lib
from tests.test_loop import tiny_config


class Died(Exception):
    """Stands for kill -9 / OOM: the process stops between a step's log and its checkpoint."""


def _steps(path):
    return [json.loads(line)["step"] for line in open(path).read().splitlines()]


@pytest.mark.slow
@pytest.mark.optimized
def test_death_between_checkpoints_then_a_step_without_its_data(tmp_path, monkeypatch):
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

    # The newest step loses its data item: the run goes on from the step before it.
    shutil.rmtree(tmp_path / "checkpoints" / "6" / "data")
    cfg.rl.steps = 4
    loop.run(cfg, work)
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6, 7]
    quarantined = os.listdir(tmp_path / "checkpoints" / "quarantine")
    assert len(quarantined) == 1 and quarantined[0].startswith("6-")
    assert ckpt_lib.CheckpointManager(tmp_path / "checkpoints").all_steps()[-1] == 7
