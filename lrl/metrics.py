"""Metrics a person can follow: the console's progress lines, phase banners and closing
summary (their format and the ETA are `lrl.console`'s), `metrics.jsonl`, TensorBoard events,
PNGs of each phase's curves, and sample completions in `samples.jsonl`. Only process 0 writes.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np

from lrl import console


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
                 stream=sys.stdout, phases: Mapping[str, int] | None = None):
        """`phases`: the run's plan in order, e.g. {"sft": 300, "grpo": 80} (steps numbered
        through the run); without it, one GRPO phase of `total_steps`."""
        self.workdir = workdir
        self.total = total_steps
        self.phases = dict(phases) if phases is not None else {"grpo": total_steps}
        self.progress = console.Progress(self.phases)
        self.primary = jax.process_index() == 0
        self.stream = stream
        self._started = self._last = time.time()
        self._tb = None
        self.history: list[dict] = []
        if self.primary:
            os.makedirs(workdir, exist_ok=True)
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
            self._samples = open(os.path.join(workdir, "samples.jsonl"), "a")
            if tensorboard:
                from tensorboardX import SummaryWriter
                self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: Mapping[str, Any], phase: str = "grpo") -> dict:
        """Records one step; returns the scalars written."""
        now = time.time()
        scalars = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        scalars["time/step_s"] = now - self._last
        self._last = now
        row = {"step": step, "phase": phase, **scalars}
        self.history.append(row)
        if not self.primary:
            return scalars
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"{phase}/{k}", v, step)
            self._tb.flush()
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

    def summary(self) -> None:
        """The closing summary, from metrics.jsonl (so a resumed run's earlier steps count):
        steps, loss / reward, held-out reward before and after, wall time, outputs."""
        if not self.primary:
            return
        path = os.path.join(self.workdir, "metrics.jsonl")
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        lines = console.summary_lines(rows, self.workdir, time.time() - self._started,
                                      self.phases)
        print("\n".join(lines), file=self.stream, flush=True)

    def samples(self, step: int, records: list[dict]) -> None:
        if self.primary:
            for r in records:
                self._samples.write(json.dumps({"step": step, **r}) + "\n")
            self._samples.flush()

    def plot(self, phase: str = "grpo") -> str | None:
        """PNG of the plotted keys over steps; returns its path."""
        if not self.primary:
            return None
        rows = [r for r in self.history if r["phase"] == phase]
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
