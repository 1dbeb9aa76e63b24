"""Weights & Biases as an optional sink (`lrl.wandb_sink`): in offline mode (no network, no
login) a run's steps, config and output files land in the W&B run under the workdir; without
wandb installed, a config that asks for it stops before any compile, naming the setting."""
import glob
import io
import json
import os
import sys
import time

import pytest

from lrl import config_util, options, wandb_sink
from lrl import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_project_without_wandb_installed_is_refused_up_front(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # what `import wandb` meets uninstalled
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    assert wandb_sink.settings(options.from_config(c, check_files=False).metrics) is None
    c.metrics.wandb_project = "lrl-runs"
    with pytest.raises(ValueError, match="metrics.wandb_project='lrl-runs' needs the wandb "
                                         "package: pip install wandb"):
        options.from_config(c, check_files=False)
    c.metrics.update(wandb_project="", wandb_mode="cloud")
    with pytest.raises(ValueError, match="metrics.wandb_mode"):
        options.from_config(c, check_files=False)


def test_offline_run_logs_steps_config_and_output_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.metrics.update(wandb_project="lrl-test", wandb_name="tiny", wandb_mode="offline")
    s = wandb_sink.settings(options.from_config(c, check_files=False).metrics)
    assert s == wandb_sink.Settings("lrl-test", "", "tiny", "offline")
    config = options.as_dict(c)
    sink = wandb_sink.Sink(s, str(tmp_path), config)
    w = metrics_lib.MetricsWriter(str(tmp_path), 2, tensorboard=False, stream=io.StringIO(),
                                  sink=sink)
    w.write(1, {"loss": 0.4375, "reward/mean": 0.1})
    w.write(2, {"loss": 0.8125, "reward/mean": 0.3})
    w.plot("grpo")
    w.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    run_id = (tmp_path / wandb_sink.ID_FILE).read_text().strip()
    assert runs[0].endswith(run_id)
    # The run's records (protobuf in W&B's own log format; its reader is not public API):
    # the steps' keys and values, the config's fields and the project are in them.
    # W&B's service process writes that file after `finish` returns: under a loaded machine
    # it held only its header when read at once (a full suite, 2026-12-06), so it is polled.
    parts = (b"grpo/loss", b"grpo/reward/mean", b"0.4375", b"0.8125", b"lrl-test",
             b"samples_per_step", b"max_new_tokens", b"metrics.jsonl")
    path, deadline = os.path.join(runs[0], f"run-{run_id}.wandb"), time.monotonic() + 60
    while True:
        records = open(path, "rb").read()
        if all(p in records for p in parts) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for part in parts:
        assert part in records, part
    files = os.path.join(runs[0], "files")
    for name in ("metrics.jsonl", "samples.jsonl", "grpo_curves.png"):
        assert os.path.exists(os.path.join(files, name)), name
    with open(os.path.join(files, "metrics.jsonl")) as f:
        assert [json.loads(x)["loss"] for x in f] == [0.4375, 0.8125]
    # A resumed run (the same workdir) continues the same W&B run.
    again = wandb_sink.Sink(s, str(tmp_path), config)
    assert again.run.id == run_id
    again.finish()
