"""Metrics a person can follow: the console's progress lines, phase banners and closing
summary (their format and the ETA are `lrl.console`'s), `metrics.jsonl`, TensorBoard events,
PNGs of each phase's curves, and sample completions in `samples.jsonl`. Only process 0 writes.

A run that dies without saving (kill -9, OOM, a lost node) has logged the steps after its
last checkpoint, and the resumed run logs them again. `MetricsWriter.resume(step, phase)`,
called once the checkpoint is restored and before the first `write`, cuts the jsonl files
back to that checkpoint (`truncate_logs`) and opens the TensorBoard events file with
`purge_step`, which makes TensorBoard hide the older files' events from the next step on.
The curves are drawn from the whole `metrics.jsonl`, so they span every run of the workdir.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np

from lrl import console

log = logging.getLogger(__name__)

LOGS = ("metrics.jsonl", "samples.jsonl")


def read_rows(path: str) -> list[dict]:
    """The rows of a jsonl log; a line that does not parse (the torn last line of a process
    that died mid-write) is left out."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return rows


def _kept(line: str, step: int, phase: str | None) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False
    s = row.get("step") if isinstance(row, dict) else None
    if not isinstance(s, int):
        return True  # not a step's row: nothing says it repeats
    if s != step:
        return s < step
    # At the checkpoint's own step, only the phase that saved it is done; another phase's
    # row there (the GRPO baseline eval after the SFT phase's last step) is written again.
    # Sample rows carry no phase: only RL steps write them, at their metrics row's step.
    return phase is not None and row.get("phase", phase) == phase


def truncate_logs(workdir: str, step: int, phase: str | None = None) -> dict[str, int]:
    """Cuts `metrics.jsonl` and `samples.jsonl` back to what a run resumed from the checkpoint
    of `step` has already logged: every row before `step`, and at `step` the rows of `phase`,
    the phase that saved that checkpoint (None, a fresh start: none, so `step=0` empties the
    logs). Each file is rewritten to a sibling and renamed over the original, so a crash here
    leaves the old file or the new one, never half of one. Returns {file: rows dropped}."""
    dropped = {}
    for name in LOGS:
        path = os.path.join(workdir, name)
        if not os.path.exists(path):
            dropped[name] = 0
            continue
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        keep = [line if line.endswith("\n") else line + "\n" for line in lines
                if _kept(line, step, phase)]
        dropped[name] = len(lines) - len(keep)
        if not dropped[name]:
            continue
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        log.info("metrics: dropped %d rows of %s logged after step %d (the restored "
                 "checkpoint); they are logged again", dropped[name], path, step)
    return dropped


def _scalar(v: Any):
    try:
        f = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class MetricsWriter:
    PLOT_KEYS = {"grpo": ("reward/mean", "response/length_mean"),
                 "sft": ("loss", "token_accuracy_lb")}

    def __init__(self, workdir: str, total_steps: int, *, tensorboard: bool = True,
                 stream=sys.stdout, phases: Mapping[str, int] | None = None, sink=None):
        """`phases`: the run's plan in order, e.g. {"sft": 300, "grpo": 80} (steps numbered
        through the run); without it, one GRPO phase of `total_steps`. `sink`: another place
        every step's scalars go (`lrl.wandb_sink.Sink`), finished at `close`."""
        self.workdir = workdir
        self.total = total_steps
        self.phases = dict(phases) if phases is not None else {"grpo": total_steps}
        self.progress = console.Progress(self.phases)
        self.primary = jax.process_index() == 0
        self.stream = stream
        self._started = self._last = time.time()
        self._tb = None
        # Opened at the first write, so that `resume` can set its purge step first.
        self._tb_dir = os.path.join(workdir, "tb") if tensorboard and self.primary else None
        self._purge_step = None
        self._written = False
        self._pending: dict = {}
        self.history: list[dict] = []
        self.sink = sink if self.primary else None
        if self.primary:
            os.makedirs(workdir, exist_ok=True)
            self._open_logs()

    def _open_logs(self):
        self._jsonl = open(os.path.join(self.workdir, "metrics.jsonl"), "a")
        self._samples = open(os.path.join(self.workdir, "samples.jsonl"), "a")

    def _tensorboard(self):
        if self._tb is None and self._tb_dir is not None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(self._tb_dir, purge_step=self._purge_step)
        return self._tb

    def resume(self, step: int, phase: str | None = None) -> dict[str, int]:
        """Before the first write of a run resumed from the checkpoint of `step` (saved by
        `phase`; `step=0, phase=None` when no checkpoint was found): drops the logged rows
        that this run writes again (see `truncate_logs`) and makes TensorBoard hide the
        older events files' steps from the next one on (from `step` itself without `phase`).
        TensorBoard purges by step alone, so after a resume from the SFT phase's last step,
        the GRPO baseline eval at that step shows twice there (not in the jsonl).
        Returns {file: rows dropped}."""
        if self._written:
            raise RuntimeError("MetricsWriter.resume must come before the first write")
        self._purge_step = step + 1 if phase is not None else step
        if not self.primary:
            return {}
        self._jsonl.close()
        self._samples.close()
        try:
            return truncate_logs(self.workdir, step, phase)
        finally:
            self._open_logs()

    def write(self, step: int, metrics: Mapping[str, Any], phase: str = "grpo") -> dict:
        """Records one step; returns the scalars written."""
        now = time.time()
        metrics, self._pending = {**self._pending, **metrics}, {}
        scalars = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        scalars["time/step_s"] = now - self._last
        self._last = now
        row = {"step": step, "phase": phase, **scalars}
        self.history.append(row)
        self._written = True
        if not self.primary:
            return scalars
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if (tb := self._tensorboard()) is not None:
            for k, v in scalars.items():
                tb.add_scalar(f"{phase}/{k}", v, step)
            tb.flush()
        if self.sink is not None:
            self.sink.log(step, phase, scalars)
        line = self.progress.line(step, phase, scalars, scalars["time/step_s"])
        if line:
            print(line, file=self.stream, flush=True)
        return scalars

    def begin_phase(self, phase: str, done: int = 0, config=None) -> None:
        """Prints the phase's banner before its first step (which compiles, so waits);
        `done`: its steps already done when resuming. Also restarts the step clock, so the
        phase's first step is not charged the previous phase's wrap-up."""
        about, eval_every = console.phase_about(config, phase) if config is not None else ("", 0)
        text = self.progress.begin(phase, done, about, eval_every)
        self._last = time.time()
        if self.primary:
            print(text, file=self.stream, flush=True)

    def with_next(self, metrics: Mapping[str, Any]) -> None:
        """Scalars measured between rows (a phase's set-up, whose time the next row's
        `time/step_s` includes), written in the next row: the phase's first step's, or its
        baseline eval's where it opens with one."""
        self._pending.update(metrics)

    def note(self, text: str) -> None:
        """A line under the phase's banner: how the phase sized itself (its programs' shapes,
        the rollout's pool), decided at its start."""
        if self.primary:
            print(f"   {text}", file=self.stream, flush=True)

    def summary(self) -> None:
        """The closing summary, from metrics.jsonl (so a resumed run's earlier steps count):
        steps, loss / reward, held-out reward before and after, wall time, outputs."""
        if not self.primary:
            return
        rows = read_rows(os.path.join(self.workdir, "metrics.jsonl"))
        lines = console.summary_lines(rows, self.workdir, time.time() - self._started,
                                      self.phases)
        print("\n".join(lines), file=self.stream, flush=True)

    def samples(self, step: int, records: list[dict]) -> None:
        self._written = True
        if self.primary:
            for r in records:
                self._samples.write(json.dumps({"step": step, **r}) + "\n")
            self._samples.flush()

    def plot(self, phase: str = "grpo") -> str | None:
        """PNG of the plotted keys over steps, from the whole `metrics.jsonl` (every run of
        the workdir, not only this process's steps); returns its path."""
        if not self.primary:
            return None
        rows = [r for r in read_rows(os.path.join(self.workdir, "metrics.jsonl"))
                if r.get("phase") == phase]
        keys = [k for k in self.PLOT_KEYS.get(phase, ("loss",)) if any(k in r for r in rows)]
        if not rows or not keys:
            return None
        # A bare Figure with its own Agg canvas: the process-wide backend (a notebook's
        # inline one, say) is left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        fig = Figure(figsize=(7, 2.6 * len(keys)))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(keys), 1, squeeze=False)
        for ax, key in zip(axes[:, 0], keys):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*pts), marker=".", alpha=0.4 if len(pts) >= 16 else 1.0, label="train")
            if len(pts) >= 16:  # per-step values are noisy: a trailing mean shows the trend
                w = 8
                xs, ys = zip(*pts)
                trail = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1])
                         for i in range(len(ys))]
                ax.plot(xs, trail, label=f"train, mean of last {w}")
            evals = [(r["step"], r[f"eval/{key}"]) for r in rows if f"eval/{key}" in r]
            if evals:
                ax.plot(*zip(*evals), marker="o", linestyle="--", label="held-out eval")
            if evals or len(pts) >= 16:
                ax.legend()
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        # Steps are numbered through the run: after 300 SFT steps, GRPO step 1 is step 301.
        start = self.progress.start(phase)
        axes[-1, 0].set_xlabel(f"{phase} step" if not start else
                               f"step of the run ({phase} step n is step {start}+n)")
        fig.tight_layout()
        path = os.path.join(self.workdir, f"{phase}_curves.png")
        fig.savefig(path, dpi=100)
        return path

    def close(self):
        if self.primary:
            self._jsonl.close()
            self._samples.close()
            if self._tb is not None:
                self._tb.close()
            if self.sink is not None:
                self.sink.finish()
