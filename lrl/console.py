"""What a run says on the console: the run banner, a banner per phase, one progress line per
step (or per N steps of a long, cheap phase), the held-out eval where it runs, an ETA from the
phase's recent steps, warnings that matter, and a closing summary that says where every output
is. Libraries' INFO logs (orbax alone writes hundreds a run) are off unless `--verbosity` is
given. Only process 0 prints.

How a phase is shown: GRPO prints every step (a step is a rollout: seconds on the default,
minutes on a real model, and each line says something new). SFT steps are cheap and many, so
an SFT phase of more than 50 steps prints a line every N steps, N the smallest of 2, 5, 10, 20,
50, ... that keeps it to 30 lines (the default's 300 steps: every 10th, with the mean step
time since the last line), plus its first step, its last and any step with an eval.
"""
from __future__ import annotations

import atexit
import logging
import os
import statistics
import sys
from typing import Iterable, Mapping, Sequence

MAX_LINES = {"sft": 30}  # progress lines of a long phase; phases not named: every step
EVERY_STEP_UP_TO = 50
WINDOW = 10           # recent steps the ETA's step time is the median of
MIN_STEPS = 3         # plain steps before an ETA: the default's GRPO steps 2-3 still compile
                      # (21 and 9.5 s against 7), and the ETA at step 2 was 3x the time left

# Library lines that look alarming and mean nothing for an lrl run.
_HARMLESS = (
    "Given directory is read only",  # orbax: export and restore open checkpoints read-only
)


def primary() -> bool:
    import jax
    return jax.process_index() == 0


# ----------------------------------------------------------------------------- logging

class _Plain(logging.Formatter):
    """`message` for INFO, `warning: message` above: no absl timestamp/thread/file prefix."""

    def format(self, record):
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {msg}"
        return msg


class _DropHarmless(logging.Filter):
    def filter(self, record):
        return record.levelno >= logging.ERROR or not any(
            h in str(record.msg) for h in _HARMLESS)


CPP_LOG = "xla.log"
_cpp_log: str | None = None   # where the C++ runtime's stderr goes, once `quiet_cpp` ran
_held: str | None = None      # the temporary file it goes to before that (`hold_cpp`)


def _redirect(path: str) -> None:
    """File descriptor 2 (the C++ runtime's stderr) to `path`, appended; the first time,
    Python's stderr and the log handlers on it move to a copy of the console's descriptor."""
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    if _cpp_log is None and _held is None:
        console = os.fdopen(os.dup(2), "w", buffering=1)
        old, sys.stderr = sys.stderr, console
        from absl import logging as absl_logging
        handlers = logging.getLogger().handlers + [absl_logging.get_absl_handler().python_handler]
        for h in handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in (old, sys.__stderr__):
                h.setStream(console)
    os.dup2(log_fd, 2)
    os.close(log_fd)


def hold_cpp() -> None:
    """Until the workdir may be written (the start-up checks must leave it as it was, yet the
    mesh they build already logs), the C++ runtime's lines go to a temporary file; `quiet_cpp`
    moves them into the workdir's log."""
    global _held
    if _cpp_log is None and _held is None:
        import tempfile
        fd, path = tempfile.mkstemp(prefix="lrl-xla-", suffix=".log")
        os.close(fd)
        _redirect(path)
        _held = path
        atexit.register(_drop_held)


def _drop_held() -> None:
    """At exit of a run that never reached its workdir (a start-up check failed): the held
    file goes if empty, else the console names it."""
    if _held is None:
        return
    try:
        if os.path.getsize(_held) == 0:
            os.remove(_held)
        else:
            print(f"XLA's log lines of this start: {_held}", file=sys.stderr)
    except OSError:
        pass


def quiet_cpp(workdir: str) -> str:
    """XLA's and its autotuner's C++ log lines (`E1204 ... gemm_fusion_autotuner ...`, written
    by the runtime straight to file descriptor 2, past Python's logging) go to
    `workdir`/xla.log, appended (with what `hold_cpp` kept before it); Python's stderr (its
    logging, warnings and tracebacks) keeps the console. Returns the log's path. Once per
    process (the CLI's: a library user's stderr is left alone)."""
    global _cpp_log, _held
    if _cpp_log is None:
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(os.path.abspath(workdir), CPP_LOG)
        if _held is not None:
            with open(_held, "rb") as src, open(path, "ab") as dst:
                dst.write(src.read())
        _redirect(path)
        if _held is not None:
            os.remove(_held)
            _held = None
        _cpp_log = path
    return _cpp_log


def setup_logging(verbose: bool = False, workdir: str | None = None) -> None:
    """Quiet by default: warnings from everyone, INFO from lrl only, without absl's prefix.
    `verbose` (main passes it when `--verbosity` is on the command line) leaves absl's levels
    and format as the flag set them, so orbax's, jax's and grain's INFO lines come back.
    Under absl's app.run the records go through absl's handler; elsewhere (lrl.export)
    through the root logger's own handlers, or a new one on stderr. With `workdir` and not
    `verbose`, the C++ runtime's log lines go to a file there (`quiet_cpp`)."""
    # transformers says "PyTorch was not found" at import: true, and irrelevant here (lrl
    # needs torch only to load an export in transformers). Must be set before that import.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from absl import logging as absl_logging
    root = logging.getLogger()
    absl_handler = absl_logging.get_absl_handler()
    if absl_handler in root.handlers:
        handlers, formatted = [absl_handler], [absl_handler.python_handler]
    else:
        if not root.handlers:
            root.addHandler(logging.StreamHandler(sys.stderr))
        handlers = formatted = list(root.handlers)
    for h in handlers:
        if not any(isinstance(f, _DropHarmless) for f in h.filters):
            h.addFilter(_DropHarmless())
    if verbose:
        return
    if workdir:
        quiet_cpp(workdir)
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs through absl's logger
    root.setLevel(logging.WARNING)
    logging.getLogger("lrl").setLevel(logging.INFO)
    for h in formatted:
        h.setFormatter(_Plain())


# ----------------------------------------------------------------------------- progress

def print_every(steps: int, max_lines: int | None) -> int:
    """Steps between progress lines of a phase of `steps` steps (see the module docstring);
    `max_lines` None: every step."""
    if max_lines is None or steps <= EVERY_STEP_UP_TO:
        return 1
    for k in _nice():
        if steps <= max_lines * k:
            return k


def _nice():
    scale = 1
    while True:
        for m in (2, 5, 10):
            yield m * scale
        scale *= 10


def eta_seconds(step_s: Sequence[float], remaining: int, eval_s: Sequence[float] = (),
                remaining_evals: int = 0, window: int = WINDOW) -> float | None:
    """Seconds until the phase ends: `remaining` steps at the median of the last `window`
    plain step times, plus `remaining_evals` evals at the mean of the last three eval costs.

    `step_s` must leave out a process's first step of the phase (it compiles) and steps with
    an eval; `eval_s` is what an eval added to its step. None until `MIN_STEPS` plain steps
    are known: an ETA from compile steps is the 1:54:08-for-ten-minutes kind."""
    if remaining <= 0:
        return 0.0
    if len(step_s) < MIN_STEPS:
        return None
    eta = statistics.median(step_s[-window:]) * remaining
    if remaining_evals and eval_s:
        eta += statistics.fmean(eval_s[-3:]) * remaining_evals
    return eta


def evals_left(done: int, steps: int, every: int) -> int:
    """Evals after step `done` of a phase that evaluates every `every` steps and at its end
    (the loop's rule)."""
    if every <= 0:
        return 0
    return sum(1 for s in range(done + 1, steps + 1) if s % every == 0 or s == steps)


def hms(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


# What a progress line shows per phase: (metric key, label).
SHOWN = {"sft": (("loss", "loss"), ("token_accuracy_lb", "token acc"), ("grad_norm", "grad")),
         "grpo": (("reward/mean", "reward"), ("response/length_mean", "length"),
                  ("loss", "loss"), ("grad_norm", "grad"))}


def held_out_text(scalars: Mapping[str, float]) -> str:
    """`held-out reward 0.46 pass@4 0.8` from a step's eval/ metrics ('' without them)."""
    if "eval/reward/mean" not in scalars:
        return ""
    passes = sorted((k for k in scalars if k.startswith("eval/pass@")),
                    key=lambda k: int(k.rsplit("@", 1)[1]))
    return " ".join([f"held-out reward {_num(scalars['eval/reward/mean'])}"] +
                    [f"{k[5:]} {_num(scalars[k])}" for k in passes[-1:]])


class _Phase:
    def __init__(self, name: str, steps: int, start: int, eval_every: int = 0):
        self.steps, self.start = steps, start
        self.every = print_every(steps, MAX_LINES.get(name))
        self.eval_every = eval_every
        self.step_s: list[float] = []     # plain steps after this process's first
        self.eval_s: list[float] = []     # what each eval added to its step
        self.baseline_s: float | None = None
        self.seen = 0
        self.since_print: list[float] = []


class Progress:
    """Turns each step's scalars into (at most) one console line; `MetricsWriter.write` calls
    `line`. `phases` is the run's plan in order, e.g. {"sft": 300, "grpo": 80}: steps are
    numbered through the run (GRPO step 1 is run step 301), lines count within the phase."""

    def __init__(self, phases: Mapping[str, int]):
        self.phases: dict[str, _Phase] = {}
        start = 0
        for name, n in phases.items():
            self.phases[name] = _Phase(name, n, start)
            start += n

    def _get(self, phase: str) -> _Phase:
        if phase not in self.phases:  # a phase outside the plan: every step, no ETA
            self.phases[phase] = _Phase(phase, 0, 0)
        return self.phases[phase]

    def start(self, phase: str) -> int:
        """The run step before the phase's first (0 for the first phase)."""
        return self._get(phase).start

    def begin(self, phase: str, done: int, about: str, eval_every: int = 0) -> str:
        """The phase's banner; `done`: its steps already done (a resumed run)."""
        ph = self._get(phase)
        ph.eval_every = eval_every
        name = phase.upper()
        cadence = "a line every step" if ph.every == 1 else f"a line every {ph.every} steps"
        where = f" (run steps {ph.start + 1}-{ph.start + ph.steps})" if ph.start else ""
        resumed = f", resuming after step {done}" if done else ""
        head = f"== {name}: {ph.steps} steps{where}{resumed}; {cadence}, ETA to the end of {name}"
        return head + (f"\n   {about}" if about else "")

    def line(self, step: int, phase: str, scalars: Mapping[str, float],
             step_s: float) -> str | None:
        ph = self._get(phase)
        local = step - ph.start
        held_out = held_out_text(scalars)
        width = len(str(ph.steps or step))
        head = f"{phase:<4} {local:>{width}}/{ph.steps or '?'}"
        if local <= 0 and held_out and "loss" not in scalars:  # the eval before step 1
            ph.baseline_s = step_s
            return f"{head}  {held_out} before step 1 ({step_s:.1f} s, compile included)"
        first = ph.seen == 0  # compiles: neither a step time nor an eval cost
        ph.seen += 1
        if not first and not held_out:
            ph.step_s.append(step_s)
        elif not first and ph.step_s:  # what the eval added to a plain step
            ph.eval_s.append(max(step_s - statistics.median(ph.step_s[-WINDOW:]), 0.0))
        ph.since_print.append(step_s)
        due = first or held_out or local % ph.every == 0 or local == ph.steps
        if not due:
            return None
        shown = [f"{label} {_num(scalars[k])}" for k, label in
                 SHOWN.get(phase, SHOWN["grpo"]) if k in scalars]
        if scalars.get("advantage/abs_mean", 1.0) == 0.0:
            shown.append("(every group's rewards equal: no gradient)")
        parts = [head, "  ".join(shown)]
        if held_out:
            parts.append(f"| {held_out}")
        if first:
            parts.append(f"| {step_s:.1f} s (first step: compiles)")
        else:
            mean = statistics.fmean(ph.since_print)
            eval_s = ph.eval_s or ([ph.baseline_s] if ph.baseline_s else [])
            eta = eta_seconds(ph.step_s, ph.steps - local, eval_s,
                              evals_left(local, ph.steps, ph.eval_every))
            timing = f"| {mean:.2f} s/step" if ph.every > 1 else f"| {step_s:.2f} s"
            show_eta = eta is not None and ph.steps and local < ph.steps
            parts.append(timing + (f"  ETA {hms(eta)}" if show_eta else ""))
        ph.since_print = []
        return "  ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- banners

def banner_lines(config, workdir: str, mesh, model_cfg) -> list[str]:
    """What runs where: model, data, devices, workdir, logging."""
    import jax
    m, d = config.model, config.data
    init = f"from {m.hf_path}" if m.hf_path else "initialised at random"
    model = (f"{model_cfg.model_type}, {model_cfg.n_layers} layers x {model_cfg.d_model} wide, "
             f"{model_cfg.num_params() / 1e6:.3g}M parameters, {init}")
    if d.source == "synthetic":
        tok = (f"tokenizer {config.tokenizer.path}" if config.tokenizer.path else
               f"a {config.tokenizer.vocab_size}-token tokenizer trained on it")
        data = f"synthetic {d.task} task (generated, nothing downloaded), {tok}"
    else:
        data = f"{d.source} {d.paths}" + (f", held out {d.eval_paths}" if d.eval_paths else "")
    devices = jax.devices()
    mesh_s = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return [f"lrl: job {config.job!r} in {workdir} (rerun the same command to resume it)",
            f"  model    {model}",
            f"  data     {data}",
            f"  devices  {len(devices)} x {devices[0].device_kind}{procs}, mesh {mesh_s}",
            "  console  libraries' INFO logs off (--verbosity=0 brings them back); "
            "every metric is in metrics.jsonl"
            + (f"; XLA's C++ log lines in {_cpp_log}" if _cpp_log else ""),
            f"  cache    {_cache_line(config, workdir)}"]


def _cache_line(config, workdir: str) -> str:
    from lrl import compile_cache
    return compile_cache.Cache(compile_cache.folder(config.compile_cache, workdir)).describe()


def banner(config, workdir: str, mesh, model_cfg) -> None:
    if primary():
        print("\n".join(banner_lines(config, workdir, mesh, model_cfg)), flush=True)


def phase_about(config, phase: str) -> tuple[str, int]:
    """(what one step of the phase is, its eval cadence) for the phase banner."""
    if phase == "sft":
        s = config.sft
        return f"a step: {s.rows} packed rows x {s.row_len} tokens, lr {s.lr:g}", 0
    rl, e = config.rl, config.eval
    about = (f"a step: {rl.prompts_per_step} prompts x {rl.group_size} samples of up to "
             f"{rl.max_new_tokens} new tokens, lr {config.optim.lr:g}")
    if e.every:
        about += (f"; held-out eval ({e.num_prompts} prompts x {e.k} samples) before step 1, "
                  f"every {e.every} steps and at the end")
    return about, e.every


# ----------------------------------------------------------------------------- summary

OUTPUTS = (  # (name in the workdir, what it is)
    ("metrics.jsonl", "every metric of every step, one JSON object a line"),
    ("samples.jsonl", "sampled prompts, completions, answers and rewards"),
    ("tb", "TensorBoard events: tensorboard --logdir {path}"),
    ("sft_curves.png", "SFT loss and token accuracy over steps"),
    ("grpo_curves.png", "GRPO reward and response length over steps, with the held-out eval"),
    ("tokenizer", "the tokenizer trained for this run"),
    ("checkpoints", "Orbax checkpoints ({steps}) and the tokenizer"),
)


def _last_rows(rows: Iterable[dict]) -> list[dict]:
    """One row per (phase, step), the last written (a resumed run may repeat a step)."""
    keyed = {}
    for r in rows:
        keyed[(r.get("phase"), r.get("step"))] = r
    return sorted(keyed.values(), key=lambda r: r.get("step", 0))


def summary_lines(rows: Iterable[dict], workdir: str, wall_s: float,
                  phases: Mapping[str, int]) -> list[str]:
    """The closing summary from metrics.jsonl's rows: steps done per phase, loss / reward at
    the start and end, held-out reward before and after, and where every output is."""
    rows = _last_rows(rows)
    lines, parts, start = [], [], 0
    for name, planned in phases.items():
        if not planned:
            continue
        mine = [r for r in rows if r.get("phase") == name and r["step"] > start]
        done = max((r["step"] - start for r in mine), default=0)
        spent = sum(r.get("time/step_s", 0.0) for r in rows if r.get("phase") == name)
        key, label = ("loss", "loss") if name == "sft" else ("reward/mean", "training reward")
        vals = [r[key] for r in mine if key in r]
        what = ""
        if vals:
            n = min(10, max(1, len(vals) // 2))
            a, b = statistics.fmean(vals[:n]), statistics.fmean(vals[-n:])
            what = (f", {label} {_num(a)} -> {_num(b)}" +
                    (f" (means of the first and last {n})" if n > 1 else ""))
        stopped = "" if done >= planned else f" (stopped early: {done} of {planned})"
        parts.append(f"{done} {name.upper()} steps in {hms(spent)}{what}{stopped}")
        evals = [(r["step"] - start, r) for r in rows
                 if r.get("phase") == name and "eval/reward/mean" in r]
        if evals:
            (s0, r0), (s1, r1) = evals[0], evals[-1]
            best_s, best = max(evals, key=lambda e: e[1]["eval/reward/mean"])
            before = "before step 1" if s0 <= 0 else f"at step {s0}"
            numbering = f"; {name.upper()} step n is run step {start}+n" if start else ""
            lines.append(f"   held-out reward {_num(r0['eval/reward/mean'])} {before} -> "
                         f"{_num(r1['eval/reward/mean'])} after step {s1} "
                         f"(best {_num(best['eval/reward/mean'])} at step {best_s}{numbering})")
        start += planned
    head = f"== done in {hms(wall_s)}: " + "; ".join(parts)
    out = [head, *lines, f"   outputs in {workdir}:"]
    for name, what in OUTPUTS:
        path = os.path.join(workdir, name)
        if not os.path.exists(path):
            continue
        if name == "checkpoints":
            steps = sorted(int(s) for s in os.listdir(path) if s.isdigit())
            listed = ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))
            what = what.format(steps=listed if steps else "none")
        what = what.format(path=path)
        shown = name + ("/" if os.path.isdir(path) else "")
        out.append(f"     {shown:<16} {what}")
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        out.append(f"   export to Hugging Face: python -m lrl.export --checkpoint="
                   f"{os.path.join(workdir, 'checkpoints')} --output={os.path.join(workdir, 'hf')}")
    return out
