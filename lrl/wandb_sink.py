"""Weights & Biases as an optional metrics sink, beside metrics.jsonl and TensorBoard
(`metrics.wandb_project`; `lrl.metrics.MetricsWriter` calls it). wandb is not a dependency of
lrl: it is imported only when a project is set, and a run that sets one without it installed
stops at start-up saying so.

What it logs: every step's scalars as `<phase>/<name>` at the run's step (as TensorBoard's),
the whole config as the W&B run's config, and at the end the output files README lists
(metrics.jsonl, samples.jsonl, the curves' plots). The W&B run's id is kept in the workdir
(`wandb_id`), so a resumed lrl run continues the same W&B run. `metrics.wandb_mode="offline"`
writes the run under `<workdir>/wandb` for `wandb sync` later (no network, no login).
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from typing import Any, Mapping, Optional

MODES = ("online", "offline")
ID_FILE = "wandb_id"
FILES = ("metrics.jsonl", "samples.jsonl", "grpo_curves.png", "sft_curves.png")


@dataclasses.dataclass(frozen=True)
class Settings:
    project: str
    entity: str = ""      # "" = the logged-in user's default
    name: str = ""        # "" = the workdir's name
    mode: str = "online"  # online | offline


def settings(metrics_opts) -> Optional[Settings]:
    """The sink's settings from `metrics.*` (None: no project, no sink)."""
    m = metrics_opts
    if not m.wandb_project:
        return None
    return Settings(m.wandb_project, m.wandb_entity, m.wandb_name, m.wandb_mode)


def require(project: str):
    """The wandb module, or a ValueError naming the setting that asks for it."""
    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"metrics.wandb_project={project!r} needs the wandb package: "
                         "pip install wandb, or leave metrics.wandb_project empty") from e
    return wandb


class Sink:
    def __init__(self, s: Settings, workdir: str, config: Mapping[str, Any]):
        wandb = require(s.project)
        self.workdir = workdir
        id_file = os.path.join(workdir, ID_FILE)
        if os.path.exists(id_file):
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(6)   # W&B's ids: letters and digits
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        self.run = wandb.init(
            project=s.project, entity=s.entity or None,
            name=s.name or os.path.basename(os.path.abspath(workdir)), mode=s.mode,
            dir=workdir, id=run_id, resume="allow", config=dict(config))
        # Plotted against the run's step (W&B's own step only counts log calls: a resumed run
        # logs again the steps after its checkpoint, as metrics.jsonl keeps them once).
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, phase: str, scalars: Mapping[str, float]) -> None:
        self.run.log({"step": step, **{f"{phase}/{k}": v for k, v in scalars.items()}})

    def finish(self) -> None:
        # Copied into the run's own folder, which W&B uploads whole at the end (offline: at
        # `wandb sync`): a file saved from elsewhere is only a reference there.
        for name in FILES:
            path = os.path.join(self.workdir, name)
            if os.path.exists(path):
                shutil.copy(path, self.run.dir)
                self.run.save(os.path.join(self.run.dir, name), base_path=self.run.dir,
                              policy="end")
        self.run.finish()
