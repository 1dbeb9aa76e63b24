"""Bad input stops a run at start-up in one plain message: a table of what users get wrong
(data, tokenizer, model checkpoint, config, rewards), each run through the entry point
(`lrl.main.run`, what `python -m lrl.main` calls) on a workdir that holds an earlier run's
files. Each row asserts the exit code, that the message names the culprit (the file or the
config key) with no traceback, and that the workdir is byte for byte what it was. Then the
real command line (exit code, no traceback, `--verbosity` adds it), an out-of-memory
message, and a real checkpoint left untouched by bad overrides of a resumed run."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from lrl import config_util, errors, main
from tests.test_loop import tiny_config
from tests import xla_env

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qwen2(path, vocab, **kw):
    import transformers
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        eos_token_id=3, **kw)).save_pretrained(str(path))


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A good local setup (tokenizer, a tiny Qwen2 checkpoint, train / held-out / SFT jsonl)
    and the broken variants of each file."""
    from lrl.data.synthetic import synthetic_corpus
    from lrl.data.tokenizer import build_tokenizer
    d = tmp_path_factory.mktemp("inputs")
    tok = build_tokenizer(synthetic_corpus(200), 300, out_dir=str(d / "tok"))
    _qwen2(d / "hf", len(tok))
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"Compute {a} + {b}.", "answer": str(a + b)}
            for a, b in rng.integers(0, 5, (16, 2))]
    f = {"tok": str(d / "tok"), "hf": str(d / "hf"),
         "train": _jsonl(d / "train.jsonl", rows), "test": _jsonl(d / "test.jsonl", rows[:8]),
         "sft": _jsonl(d / "sft.jsonl", [{**r, "response": r["answer"]} for r in rows])}
    f["empty"] = _jsonl(d / "empty.jsonl", [])
    f["no_answer"] = _jsonl(d / "no_answer.jsonl", [{"prompt": r["prompt"]} for r in rows])
    f["not_json"] = _jsonl(d / "not_json.jsonl", ["{'prompt': 1", "prompt,answer"])
    f["few"] = _jsonl(d / "few.jsonl", rows[:3])
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), str(d / "q.parquet"))
    f["parquet"] = str(d / "q.parquet")

    def broken(name, src, edit):
        shutil.copytree(src, d / name)
        edit(d / name)
        f[name] = str(d / name)

    broken("hf_bad_json", f["hf"], lambda p: (p / "config.json").write_text("{\"model_type\": "))
    broken("hf_wide", f["hf"], lambda p: _edit_json(p / "config.json", hidden_size=48))
    broken("hf_untied", f["hf"], lambda p: _edit_json(p / "config.json",
                                                      tie_word_embeddings=False))
    broken("hf_cut", f["hf"], lambda p: _cut(p / "model.safetensors"))
    broken("hf_no_config", f["hf"], lambda p: os.remove(p / "config.json"))
    _qwen2(d / "hf_small_vocab", 280)
    f["hf_small_vocab"] = str(d / "hf_small_vocab")
    broken("tok_corrupt", f["tok"],
           lambda p: (p / "tokenizer.json").write_bytes(np.random.default_rng(1).bytes(4096)))

    def no_template(p):
        _edit_json(p / "tokenizer_config.json", chat_template=None)
        for t in p.glob("chat_template.*"):
            os.remove(t)
    broken("tok_no_template", f["tok"], no_template)
    return f


def _edit_json(path, **fields):
    data = json.loads(path.read_text())
    for k, v in fields.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def _cut(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _config(f, **over):
    """configs/default.py:runlocal on the local files, sized for the suite's 8 devices."""
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.data.update(source="jsonl", paths=f["train"], eval_paths=f["test"])
    c.tokenizer.path = f["tok"]
    c.model.hf_path = f["hf"]
    c.sft.update(steps=2, paths=f["sft"])
    c.reward.spec = "math:1.0"
    c.mesh.update(data=1, fsdp=4, tensor=2)
    c.eval.update(every=3, num_prompts=8)
    c.metrics.tensorboard = False
    for key, value in over.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if isinstance(value, str) and value.startswith("@"):
            value = f[value[1:]]
        with node.ignore_type():
            node[leaf] = value
    return c


def _snapshot(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _old_workdir(path):
    """A workdir an earlier run left: logs and a checkpoint step's files."""
    os.makedirs(path / "checkpoints" / "4" / "state")
    (path / "checkpoints" / "4" / "state" / "blob").write_bytes(b"\x01" * 64)
    (path / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    return str(path)


# (row id, config overrides ("@name": a file of the fixture), what the message must name)
CASES = [
    ("empty train jsonl", {"data.paths": "@empty"}, ["empty.jsonl", "empty"]),
    ("no row has the answer field", {"data.paths": "@no_answer"},
     ["no_answer.jsonl", "missing field 'answer'", "data.answer_field"]),
    ("rows that are not JSON", {"data.paths": "@not_json"}, ["not_json.jsonl:1", "not JSON"]),
    ("data.paths file missing", {"data.paths": "/no/such/train.jsonl"},
     ["data.paths", "/no/such/train.jsonl"]),
    ("parquet without the prompt column", {"data.paths": "@parquet", "data.source": "parquet",
                                           "data.eval_paths": ""},
     ["q.parquet", "'prompt'"]),
    ("every prompt longer than the limit", {"data.max_prompt_len": 4},
     ["data.max_prompt_len=4", "train.jsonl"]),
    ("held-out file empty", {"data.eval_paths": "@empty"}, ["empty.jsonl", "held-out"]),
    ("held-out rows fewer than an eval batch", {"data.eval_paths": "@few"},
     ["data.eval_paths", "eval.num_prompts=8"]),
    ("SFT file empty", {"sft.paths": "@empty"}, ["empty.jsonl", "SFT data"]),
    ("SFT rows lack the response", {"sft.paths": "@train"},
     ["train.jsonl", "missing field 'response'", "sft.response_field"]),
    ("model.hf_path missing", {"model.hf_path": "/no/such/model"},
     ["model.hf_path", "/no/such/model"]),
    ("model dir without config.json", {"model.hf_path": "@hf_no_config"},
     ["hf_no_config", "config.json"]),
    ("config.json not JSON", {"model.hf_path": "@hf_bad_json"},
     ["hf_bad_json/config.json", "not valid JSON", "copy"]),
    ("config.json shapes not the weights'", {"model.hf_path": "@hf_wide"},
     ["hf_wide/config.json", "model.embed_tokens.weight", "[300, 32]", "[300, 48]"]),
    ("untied config, tied weights", {"model.hf_path": "@hf_untied"},
     ["hf_untied", "lm_head.weight", "missing"]),
    ("truncated safetensors", {"model.hf_path": "@hf_cut"},
     ["hf_cut/model.safetensors", "truncated"]),
    ("tokenizer vocabulary past the model's", {"model.hf_path": "@hf_small_vocab"},
     ["tokenizer.path", "300 tokens", "280"]),
    ("corrupt tokenizer.json", {"tokenizer.path": "@tok_corrupt"},
     ["tok_corrupt/tokenizer.json"]),
    ("tokenizer without a chat template", {"tokenizer.path": "@tok_no_template"},
     ["tokenizer.path", "tok_no_template", "chat template"]),
    ("tokenizer.path empty for file data", {"tokenizer.path": ""},
     ["tokenizer.path", "set --config.tokenizer.path"]),
    ("unknown reward", {"reward.spec": "maths:1.0"}, ["reward.spec", "unknown reward 'maths'"]),
    ("unknown config key", {"rl.group_sise": 4}, ["config section rl", "group_sise"]),
    ("value out of bounds", {"rl.group_size": 0}, ["config key rl.group_size", ">= 1"]),
    ("prompts that do not divide over the data shards", {"rl.prompts_per_step": 6},
     ["rl.prompts_per_step=6", "multiple of 4"]),
    ("mesh larger than the devices", {"mesh.data": 3}, ["config section mesh", "24 devices"]),
    ("synthetic eval set smaller than a batch",
     {"data.source": "synthetic", "data.eval_size": 0, "tokenizer.path": "", "sft.paths": "",
      "model.hf_path": "", "reward.spec": "synthetic"}, ["data.eval_size", "eval.num_prompts"]),
]


@pytest.mark.parametrize("name,over,needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_stops_at_start_up_in_one_message(files, tmp_path, capsys, name, over,
                                                    needles):
    work = _old_workdir(tmp_path / "run")
    before = _snapshot(work)
    t0 = time.perf_counter()
    code = main.run(_config(files, **over), work)
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == errors.EXIT_CODE, err
    lines = [x for x in err.splitlines() if x.startswith(f"{errors.PROG}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].count(" — ") >= 2, lines[0]   # what — culprit — what to do
    for needle in needles:
        assert needle in err, (needle, err)
    assert _snapshot(work) == before
    assert took < 30, took   # start-up only: nothing compiled, no phase ran


def test_the_table_covers_what_the_issue_lists():
    assert len(CASES) >= 15


def test_a_good_setup_passes_every_check(files, tmp_path):
    from lrl import preflight
    opts = preflight.options(_config(files))
    times = preflight.run(opts, str(tmp_path / "run"))
    assert {"tokenizer", "checkpoint", "model", "data", "eval_data", "sft_data", "rewards",
            "resume", "prompt_lengths"} <= set(times)
    assert not (tmp_path / "run").exists()


def test_out_of_memory_names_the_numbers_and_the_settings(capsys):
    import jax
    c = tiny_config()

    def oom():
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.")
    assert errors.run(oom, config=c) == errors.EXIT_CODE
    err = capsys.readouterr().err
    assert "17179869184 bytes" in err and "Traceback" not in err
    assert "rl.max_tokens_per_micro (now 4096)" in err and "rollout.pool_fraction (now 0.4)" in err

    def bug():
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    with pytest.raises(jax.errors.JaxRuntimeError):   # not the person's: its traceback
        errors.run(bug, config=c)


def test_out_of_pinned_host_memory_names_its_cap_not_the_device(capsys, monkeypatch):
    """The 7B run's checkpoint ran out of the pinned host memory jax's GPU client caps (the
    offloaded optimizer lives there): the message names that cap and the settings that hold
    less in host memory, not the device's micro-batch and pool."""
    import jax
    c = tiny_config()
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")

    def oom():
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of host memory while trying to allocate 1.01GiB with "
            "allocator xla_gpu_host_bfc on device 0. Please set the environment variable "
            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to allocate larger host memory than the default "
            "64 GB.")
    assert errors.run(oom, config=c) == errors.EXIT_CODE
    err = capsys.readouterr().err
    assert "out of pinned host memory" in err and "1.01GiB" in err and "Traceback" not in err
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100" in err
    assert "optim.offload='off' (now 'auto')" in err and "rl.max_tokens_per_micro" not in err


def _main(*args, timeout=300, tmpdir=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    env["XLA_FLAGS"] = xla_env.SPEED_FLAGS  # one CPU device (a user's laptop), fast compiles
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "lrl.main", *args], cwd=ROOT, timeout=timeout,
                         capture_output=True, text=True, env=env)
    return out, time.perf_counter() - t0


@pytest.mark.slow
def test_the_command_line_exits_2_without_a_traceback(files, tmp_path):
    common = ["--config=configs/qwen2_5_math.py", f"--workdir={tmp_path / 'run'}",
              f"--config.tokenizer.path={files['tok_corrupt']}",
              f"--config.model.hf_path={files['hf']}", f"--config.data.paths={files['train']}",
              "--config.data.prompt_field=prompt"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out, _ = _main(*common, tmpdir=tmp)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "tok_corrupt/tokenizer.json" in out.stderr
    assert not (tmp_path / "run").exists()
    # The file XLA's lines were held in until the workdir could be written goes too (empty).
    assert not list(tmp.glob("lrl-xla-*")), list(tmp.iterdir())
    out, _ = _main(*common, "--verbosity=0")   # the traceback first, then the same message
    err = out.stderr
    assert out.returncode == 2 and "Traceback" in err, err
    assert err.index("Traceback") < err.index(f"{errors.PROG}: error: the tokenizer does not load")


@pytest.mark.slow
def test_bad_overrides_leave_a_real_checkpoint_and_its_logs_alone(files, tmp_path, capsys):
    work = str(tmp_path)
    c = tiny_config()
    c.eval.every, c.sft.steps, c.rl.steps = 0, 0, 1
    assert main.run(c, work) == 0
    before = _snapshot(work)
    assert any(k.startswith("checkpoints/1/") for k in before) and "metrics.jsonl" in before
    for over, needles in ((dict(d_model=64), ["model.d_model", "checkpoint 32, this run 64"]),
                          (dict(n_layers=3), ["model.n_layers"])):
        bad = tiny_config()
        bad.eval.every, bad.sft.steps, bad.rl.steps = 0, 0, 2
        bad.model.update(**over)
        assert main.run(bad, work) == errors.EXIT_CODE
        err = capsys.readouterr().err
        assert all(n in err for n in needles), err
        assert _snapshot(work) == before
    bad = tiny_config()
    bad.eval.every, bad.sft.steps, bad.rl.steps = 0, 0, 2
    bad.reward.spec = "nope"
    assert main.run(bad, work) == errors.EXIT_CODE
    assert "reward.spec" in capsys.readouterr().err and _snapshot(work) == before
