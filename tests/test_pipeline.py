"""The one-step-off pipeline (`pipeline.rollout_devices`, `lrl.pipeline`) on 8 CPU devices, 4
training and 4 sampling: the weights reach the rollout mesh exactly and device to device; a
pipelined run through `lrl.loop.run` equals a synchronous run on one mesh whose rollout of
step t is fed the weights of step t-1 (and each rollout got exactly the weights the training
mesh had before the update it ran beside); it reports its rollout, update and overlap times
and sample ages; a resume after SIGTERM, with the batch sampled ahead saved in the
checkpoint, equals the uninterrupted run; options that cannot work fail at start-up naming
the option (through `lrl.main` too)."""
import dataclasses
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl import checkpoint as ckpt_lib
from lrl import build, collect, config_util, loop, models, pipeline, rewards
from lrl import mesh as mesh_lib
from lrl import metrics as metrics_lib
from lrl.groups import Groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@rewards.register("test_pipeline_chars")
def chars_reward(completion: str, answer: str, **meta) -> float:
    """Varies on an untrained model's samples, so every step has a gradient."""
    return len(set(completion)) / 10.0


def tiny_config(rollout_devices=4):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64)
    c.data.task_kwargs.arithmetic.update(num_terms=2, min_terms=2)
    c.data.max_prompt_len = 96
    c.sft.steps = 0
    c.rl.update(steps=3, prompts_per_step=4, group_size=2, max_new_tokens=6, row_len=128,
                mismatch_fraction=0.0)
    # 4 training devices (fsdp 2 x tensor 2) and 4 sampling, or the same data shards (the
    # prompt order follows them) over all 8 for the synchronous reference.
    c.mesh.update(fsdp=2, tensor=2 if rollout_devices else 4)
    c.pipeline.rollout_devices = rollout_devices
    c.eval.every = 0
    c.checkpoint.update(every_steps=1, keep=10)
    c.optim.lr = 1e-3
    c.metrics.tensorboard = False
    c.reward.update(num_workers=0, spec="test_pipeline_chars:1.0")
    return c


def _params(workdir, step=None):
    return ckpt_lib.restore_params(os.path.join(workdir, "checkpoints"), step=step).state


def _rows(workdir):
    return [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]


def _texts(workdir):
    return [(r["step"], r["completion"]) for r in
            map(json.loads, open(os.path.join(workdir, "samples.jsonl")))]


def _close(a_tree, b_tree, **tol):
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The pipelined run, 3 steps, recording the weights each rollout was handed."""
    workdir = str(tmp_path_factory.mktemp("pipelined"))
    handed = {}
    sample = pipeline.sample

    def recording(p, params, it, step_index, age):
        handed[step_index] = jax.tree.map(np.asarray, params)
        return sample(p, params, it, step_index, age)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "sample", recording)
        loop.run(tiny_config(), workdir)
    return workdir, handed


@pytest.mark.parametrize("rollout_tensor", [0, 2])
def test_the_handover_is_exact_and_never_passes_through_the_host(monkeypatch, rollout_tensor):
    c = tiny_config()
    c.pipeline.rollout_tensor = rollout_tensor
    mesh, rollout_mesh = mesh_lib.build_meshes(build.options(c, check_files=False))
    tensor = rollout_tensor or 4   # the rest of the rollout devices hold copies
    assert dict(rollout_mesh.shape) == dict(data=1, fsdp=4 // tensor, seq=1, tensor=tensor)
    assert not set(mesh.devices.flat) & set(rollout_mesh.devices.flat)
    cfg = models.ModelConfig(model_type="qwen2", vocab_size=64, d_model=32, n_layers=2,
                             n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
    params = models.init_params(cfg, jax.random.key(0), mesh)
    hand = pipeline.handover(params, mesh, rollout_mesh)
    want = jax.tree.map(np.asarray, params)
    from jax._src import array as array_lib   # a host round trip reads an array's _value

    def no_host(self):
        raise AssertionError("the handover read an array back to the host")
    if hasattr(array_lib.ArrayImpl, "_value"):
        monkeypatch.setattr(array_lib.ArrayImpl, "_value", property(no_host))
    out = hand(params)
    assert hand(params) is out   # the same params are not copied twice
    monkeypatch.undo()
    for x in jax.tree.leaves(out):
        assert set(x.sharding.device_set) == set(rollout_mesh.devices.flat)
    # In the decode rules' layout: heads over the rollout's tensor axis, nothing over fsdp.
    assert tuple(out["layers"]["q_proj"]["kernel"].sharding.spec) == (None, None, "tensor", None)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow
def test_pipelined_steps_equal_a_synchronous_run_on_weights_one_step_old(
        straight, tmp_path, monkeypatch):
    workdir, handed = straight
    rows = [r for r in _rows(workdir) if r["phase"] == "grpo"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Step 1 samples its own batch (age 0), then every step trains on the one sampled beside
    # the step before, under the weights before that step's update (age 1).
    assert [r["pipeline/age_mean"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0
        for k in ("update_s", "rollout_s", "wall_s", "saved_s", "overlap", "handover_s"):
            assert np.isfinite(r[f"pipeline/{k}"]), k
        assert r["pipeline/wall_s"] <= r["pipeline/update_s"] + r["pipeline/rollout_s"] + 0.05
    assert rows[0]["pipeline/rollout_s"] > 0 and rows[-1]["pipeline/rollout_s"] == 0
    assert rows[-1]["compiles/step"] == 0   # the handover, rollout and update compiled once
    # Batch i (0-based: of logged step i+1) was sampled under exactly the weights after i-1
    # updates: batches 0 and 1 under w_0, batch 2 under w_1 (the checkpoint of step 1).
    assert sorted(handed) == [0, 1, 2]
    w = {t: _params(workdir, step=t) for t in (1, 2, 3)}
    for a, b, c in zip(*(jax.tree.leaves(x) for x in (handed[0], handed[1], handed[2]))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(handed[2]), jax.tree.leaves(w[1])):
        np.testing.assert_array_equal(a, np.asarray(b))

    # The reference: one mesh, rollout and update in turn, the rollout of step t fed the
    # weights step t-1 started from (step 0: its own).
    synchronous, seen = collect.collect, []

    def lagged(s, params, it, step_index):
        seen.append(jax.tree.map(jnp.copy, params))   # copies: the update donates the state
        groups, m = synchronous(s, seen[max(step_index - 1, 0)], it, step_index)
        ages = np.full(len(groups.completions), min(step_index, 1), np.int32)
        return dataclasses.replace(groups, ages=ages), m

    monkeypatch.setattr(collect, "collect", lagged)
    ref = str(tmp_path / "reference")
    loop.run(tiny_config(rollout_devices=0), ref)
    assert _texts(ref) == _texts(workdir)
    ref_rows = [r for r in _rows(ref) if r["phase"] == "grpo"]
    for a, b in zip(ref_rows, rows):
        for k in ("reward/mean", "response/length_mean", "loss"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # Adam divides by the gradients' scale, so where they are near zero the split mesh's and
    # the one mesh's summation orders show in the weights: 4.3e-6 on one CPU, under 1e-6 on
    # another. The lag this test is about moves them by more than 1e-4 (below).
    for t in (1, 2, 3):
        _close(_params(ref, step=t), w[t], rtol=1e-4, atol=1e-5)
    # ... which is not the synchronous run: the steps moved the weights the lag is over.
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(w[1]), jax.tree.leaves(handed[1])))
    assert moved > 1e-4


@pytest.mark.slow
def test_resume_after_sigterm_trains_the_saved_batch_and_equals_the_uninterrupted_run(
        straight, tmp_path, monkeypatch):
    workdir, _ = straight
    write = metrics_lib.MetricsWriter.write

    def write_then_sigterm(self, step, metrics, phase="grpo"):
        scalars = write(self, step, metrics, phase)
        if step == 1:   # the handler only sets a flag: the loop saves after the step
            os.kill(os.getpid(), signal.SIGTERM)
        return scalars

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_sigterm)
    cut = str(tmp_path / "cut")
    loop.run(tiny_config(), cut)
    assert ckpt_lib.CheckpointManager(os.path.join(cut, "checkpoints")).all_steps()[-1] == 1
    # The batch sampled beside step 1, finished and scored, saved with its state.
    data = json.load(open(os.path.join(cut, "checkpoints", "1", "data", "metadata")))
    assert data["step"] == 1 and data["pipeline_batch"]["ages"] == [1] * 8
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
    loop.run(tiny_config(), cut)   # resumes at step 2 with the batch sampled beside step 1
    _close(_params(cut), _params(workdir), rtol=1e-6, atol=1e-7)
    assert _texts(cut) == _texts(workdir)
    got, want = _rows(cut), _rows(workdir)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        for k in ("reward/mean", "loss", "pipeline/age_mean"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)


def test_the_batch_sampled_ahead_round_trips_through_the_data_state():
    from lrl.checkpoint_items import decode_data, encode_data
    from lrl.tasks import Prompt
    prompts = (Prompt(np.array([3, 4, 5], np.int32), "7", {"task": "arithmetic"}, "3+4"),
               Prompt(np.array([6], np.int32), "1", {}, "6"))
    logps = tuple(np.random.RandomState(i).randn(n).astype(np.float32)
                  for i, n in enumerate((2, 1, 3, 2)))
    groups = Groups(prompts, tuple(np.arange(len(x), dtype=np.int32) for x in logps),
                            logps, 2, np.array([0, 1, 0, 0], bool), ("a", "b", "c", "d"),
                            np.array([[0.1, 0.2], [0.3, 1 / 3]], np.float32),
                            np.ones(4, np.int32))
    state = json.loads(json.dumps(encode_data(pipeline.to_state(
        pipeline.Batch(groups, {"reward/mean": np.float32(0.25), "rollout/x": 3})))))
    back = pipeline.from_state(decode_data(state)["pipeline_batch"])
    g = back.groups
    assert g.texts == groups.texts and g.group_size == 2
    for a, b in zip(g.prompts, prompts):
        np.testing.assert_array_equal(a.ids, b.ids)
        assert (a.answer, a.meta, a.text) == (b.answer, b.meta, b.text)
    for a, b in zip(g.logps + g.completions, logps + groups.completions):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(g.rewards_PG, groups.rewards_PG)
    np.testing.assert_array_equal(g.truncated, groups.truncated)
    np.testing.assert_array_equal(g.sample_ages(), groups.sample_ages())
    assert back.metrics == {"reward/mean": 0.25, "rollout/x": 3.0}
    broken = decode_data(state)["pipeline_batch"]
    broken["ages"] = broken["ages"][:-1]
    with pytest.raises(ValueError, match="do not match"):
        pipeline.from_state(broken)


@pytest.mark.parametrize("changes,match", [
    (dict(rollout_tensor=3), r"pipeline.rollout_tensor=3 does not divide "
                             r"pipeline.rollout_devices=4"),
    (dict(rollout_devices=0, rollout_tensor=2), r"pipeline.rollout_tensor=2 shapes"),
    (dict(partial=True), r"pipeline.rollout_devices=4 with rollout.partial=True is not built"),
    (dict(job="sft"), r"pipeline.rollout_devices=4 pipelines GRPO's rollout; job='sft'"),
    (dict(distributed=True), r"pipeline.rollout_devices=4 runs in one process only"),
])
def test_options_the_pipeline_cannot_run_with_fail_naming_the_option(changes, match):
    c = tiny_config()
    c.pipeline.update({k: v for k, v in changes.items() if k.startswith("rollout_")})
    if changes.get("partial"):
        c.rollout.partial = True
    if "job" in changes:
        c.job, c.sft.steps = changes["job"], 3
    if changes.get("distributed"):
        c.distributed.enabled = True
    with pytest.raises(ValueError, match=match):
        build.options(c, check_files=False)


def test_the_video_task_is_refused():
    c = config_util.load(os.path.join(ROOT, "configs", "video_synthetic.py"), "runlocal")
    c.pipeline.rollout_devices = 4
    with pytest.raises(ValueError, match=r"pipeline.rollout_devices=4 runs on the text task"):
        build.options(c, check_files=False)


@pytest.mark.parametrize("rollout,tensor,mesh,match", [
    (8, 0, dict(fsdp=-1, tensor=1), r"pipeline.rollout_devices=8 of the 8 devices leaves "
                                    r"none to train"),
    (4, 0, dict(fsdp=4, tensor=2), r"needs 8 devices, 4 are present.*"
                                   r"pipeline.rollout_devices=4 leaves 4 devices"),
    (3, 3, dict(fsdp=-1, tensor=1), r"pipeline.rollout_tensor=3 does not divide the 5 "
                                    r"training devices"),
])
def test_device_counts_that_do_not_split_fail_naming_the_option(rollout, tensor, mesh, match):
    c = tiny_config()
    c.pipeline.update(rollout_devices=rollout, rollout_tensor=tensor)
    c.mesh.update(mesh)
    with pytest.raises(ValueError, match=match):
        mesh_lib.build_meshes(build.options(c, check_files=False))
    if rollout == 3:   # 3 and 5 split as asked otherwise
        c.pipeline.rollout_tensor = 0
        c.mesh.update(fsdp=5)
        c.pipeline.update(rollout_devices=3, rollout_tensor=1)
        train, roll = mesh_lib.build_meshes(build.options(c, check_files=False))
        assert train.devices.size == 5 and roll.shape["fsdp"] == 3
        assert list(roll.devices.flat) == jax.devices()[5:]


def test_lrl_main_refuses_a_pipeline_without_training_devices(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lrl.main", "--config=configs/default.py:runlocal",
         f"--workdir={tmp_path}", "--config.pipeline.rollout_devices=8"], cwd=ROOT,
        timeout=300, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode != 0 and "pipeline.rollout_devices=8" in out.stderr
    assert not os.path.exists(tmp_path / "checkpoints")   # nothing started
