"""The Colab notebooks under experiments/notebooks execute headless, start to finish, on
their smoke settings (LRL_NOTEBOOK_SMOKE=1: a handful of steps), so they never rot.

Each runs in a fresh IPython kernel (nbclient + ipykernel) with the repository found from the
notebook's folder and the install step skipped (LRL_SKIP_INSTALL=1); a cell that raises fails
the test with that cell's error. Beyond "no error", each test checks what the notebook exists
to show: the reward plot, ring = dense and the falling per-device memory, the exported model
generating with transformers.
"""
from __future__ import annotations

import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "experiments", "notebooks")
CELL_TIMEOUT_S = 240
# Whole-notebook wall limit: a kernel that never starts, or a client that never returns from
# its cleanup, fails the test here instead of holding the suite until CI's own limit.
NOTEBOOK_TIMEOUT_S = 900
ATTEMPTS = 2

# The notebook runs in a child process so that a hung kernel or client can be killed; a
# kernel that fails to start (exit 3) or a child that hangs is retried once, a cell's error
# is not (it would fail again the same way).
_CHILD = r"""
import sys, nbformat, nbclient
src, dst, cell_timeout, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
nb = nbformat.read(src, as_version=4)
client = nbclient.NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                                 resources={"metadata": {"path": path}})
try:
    client.execute()
except nbclient.exceptions.CellExecutionError as e:
    print(e, file=sys.stderr)
    sys.exit(1)
except (RuntimeError, nbclient.exceptions.DeadKernelError, TimeoutError) as e:
    print(f"kernel: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
nbformat.write(nb, dst)
"""


def _execute(path: str):
    """Runs the notebook at `path` in a fresh kernel; returns it with its outputs."""
    import signal
    import subprocess
    import sys
    import tempfile
    failures = []
    for attempt in range(1, ATTEMPTS + 1):
        with tempfile.TemporaryDirectory() as tmp:
            dst, log = os.path.join(tmp, "out.ipynb"), os.path.join(tmp, "stderr.txt")
            # stderr to a file, not a pipe: a kernel that outlives a killed child would keep
            # a pipe open and hang the read.
            with open(log, "w") as err:
                child = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, path, dst, str(CELL_TIMEOUT_S), NOTEBOOKS],
                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
                try:
                    code = child.wait(timeout=NOTEBOOK_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    code = None
            with open(log) as f:
                tail = f.read()[-6000:]
            if code == 0:
                return nbformat.read(dst, as_version=4)
            failures.append(f"attempt {attempt}: " + (
                f"no result in {NOTEBOOK_TIMEOUT_S} s" if code is None else f"exit {code}")
                + f"\n{tail}")
            if code not in (None, 3):
                break
    pytest.fail(f"{os.path.basename(path)} did not run:\n" + "\n".join(failures))


def _run(name: str, monkeypatch, workdir=None, devices: int | None = 1):
    """Executes a notebook; returns (notebook with outputs, all text output joined)."""
    monkeypatch.setenv("LRL_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("LRL_SKIP_INSTALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # The kernel inherits this process's environment (8 virtual devices for the suite);
    # a Colab CPU runtime has one device, which is what the training notebooks get here.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    if devices is not None:
        flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    monkeypatch.setenv("XLA_FLAGS", flags)
    if workdir is not None:
        monkeypatch.setenv("LRL_NOTEBOOK_WORKDIR", str(workdir))
    nb = _execute(os.path.join(NOTEBOOKS, f"{name}.ipynb"))
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif "data" in out and "text/plain" in out["data"]:
                text.append(out["data"]["text/plain"])
    return nb, "\n".join(text)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells
               for out in cell.get("outputs", []))


def test_notebooks_are_clean_and_first_cell_installs():
    """Committed without outputs; the first code cell is the (skippable) install step."""
    for name in ("quickstart", "long_context", "export"):
        nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), name
        first = code[0].source
        assert "pip" in first and "LRL_SKIP_INSTALL" in first and "requirements.txt" in first
        assert "LRL_NOTEBOOK_SMOKE" in first, name
        # On Colab the cell clones the repository from a URL the user sets in the cell itself.
        assert 'LRL_REPO = os.environ.get("LRL_REPO", "")' in first, name
        assert '"git", "clone", "--depth=1", LRL_REPO' in first, name


def test_notebooks_describe_the_task_they_run():
    """The default config's synthetic task is arithmetic; the notebooks must say that."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("default_cfg",
                                                  os.path.join(ROOT, "configs", "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    task = mod.get_config().data.task
    assert task == "arithmetic"
    for name in ("quickstart", "export"):
        nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
        text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert "arithmetic" in text and "key-value" not in text, name


@pytest.mark.slow
def test_quickstart(tmp_path, monkeypatch):
    nb, text = _run("quickstart", monkeypatch, workdir=tmp_path)
    assert _images(nb) == 1  # the reward plot
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["phase"] for r in rows] == ["sft"] * 10 + ["grpo"] * 2
    assert all("reward/mean" in r for r in rows if r["phase"] == "grpo")
    assert "reward" in text and "->" in text  # the samples were printed


@pytest.mark.slow
def test_long_context(monkeypatch):
    nb, text = _run("long_context", monkeypatch, devices=None)  # the notebook sets 8
    assert "CpuDevice(id=7)" in text
    for n in (1, 2, 4, 8):
        assert f"seq shards {n}: max |ring - dense|" in text
        assert f"seq shards {n}: {2048 // n:5d} tokens per device" in text
    assert _images(nb) == 1  # the memory bar chart


@pytest.mark.slow
@pytest.mark.optimized
def test_export(tmp_path, monkeypatch):
    nb, text = _run("export", monkeypatch, workdir=tmp_path)
    files = set(os.listdir(tmp_path / "hf"))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files, files
    assert "transformers ->" in text and "lrl          ->" in text
    assert "max relative logit difference lrl vs transformers" in text
    assert "same greedy tokens:" in text
