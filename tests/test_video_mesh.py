"""Video GRPO on a device mesh (Long-RL's MR-SP stage 2): the multimodal update with ring /
Ulysses attention over `seq` equals the single-device dense update; sequence-parallel prefill
writes the pages the engine's prefill writes (same greedy samples and log-probs); video GRPO
runs through `lrl.loop.run` on an fsdp x seq mesh, checkpoints and resumes at the saved data position; the video-QA
config reads a local jsonl and reports missing videos and malformed rows."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lrl import build, loop, models
from lrl import mesh as mesh_lib
from lrl.config_util import load as config_from_file
from lrl.data import packing, video_task
from lrl.models import vision, vl
from lrl import rl as lrl_rl
from lrl.rewards import register
from lrl.rl import update as update_lib
from lrl.rl.losses import LossConfig
from lrl.rollout import Engine, EngineConfig, SamplingParams, sp_prefill
from lrl.tasks import Prompt, video, video_data
from tests.hf_util import rel_err

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
TEXT = models.ModelConfig(model_type="qwen2", vocab_size=160, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True,
                          mrope_section=(1, 1, 2), remat="none")
VL = vl.VLConfig(TEXT, vision.VisionConfig(depth=1, out_hidden_size=32), image_token_id=150,
                 video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)
GRID = (2, 4, 4)   # 8 visual tokens


def _video_prompt(text_ids):
    n = VL.tokens_per_item(GRID)
    ids = np.array([3, 152] + [151] * n + [153] + list(text_ids), np.int32)
    pos, delta = vl.mrope_positions(VL, ids, video_grids=[GRID])
    return ids, pos, delta, n


# ----------------------------------------------------------------------------- the update

def _groups_and_rows(rng):
    """Two video prompts (table rows 0 and 8), G=3 random completions each, packed."""
    G, prompts = 3, []
    for p in range(2):
        ids, pos, delta, n = _video_prompt(rng.randint(0, 140, 4 + 3 * p))
        prompts.append(Prompt(ids, "a", {}, "", visual=video.VisualRows(None, n, pos, delta)))
    comps = [rng.randint(0, 150, rng.randint(3, 9)).astype(np.int32) for _ in range(2 * G)]
    comps[1][1] = VL.video_token_id           # a sampled pad stays an ordinary token
    adv = np.asarray(lrl_rl.advantages(rng.rand(2, G).astype(np.float32), "grpo")).reshape(-1)
    rows, layout = packing.pack(
        [prompts[i // G].ids for i in range(2 * G)], comps, 32,
        seq_values={"advantages": adv},
        token_values={"old_logp": [(-rng.rand(len(c)) * 0.3).astype(np.float32) for c in comps]},
        rows_multiple=4, truncate=True)
    return video.add_visual_rows(VL, rows, layout, [prompts[i // G] for i in range(2 * G)],
                                 [8 * (i // G) for i in range(2 * G)])


@pytest.mark.slow
def test_vl_update_with_ring_attention_equals_the_single_device_step():
    attention, sizes = "ring", {"fsdp": 2, "seq": 4}
    rng = np.random.RandomState(0)
    params = models.init_params(TEXT, jax.random.key(0))
    table = jax.random.normal(jax.random.key(1), (16, TEXT.d_model))
    rows = _groups_and_rows(rng)
    assert (rows["visual_index"] >= 0).sum() == 3 * 8 * 2 and rows["positions"].shape[1] == 3
    tx = optax.sgd(1e4)          # new params = params - 1e4 grads: no cancellation error
    loss = LossConfig(aggregation="token_mean", max_len=8)
    before = jax.tree.map(np.asarray, params)   # the steps donate their input state
    state = update_lib.init_train_state(params, tx)
    vl_step = dict(num_micro=2, hidden=vl.batch_hidden_states, extra_keys=("visual_index",))
    want_state, want = update_lib.make_update_fn(TEXT, loss, tx, **vl_step)(
        jax.tree.map(jnp.copy, state), mesh_lib.put_batch(None, rows), table)
    mesh = mesh_lib.make_mesh(sizes)
    cfg = TEXT.replace(attention=attention)
    sharded = jax.device_put(state, update_lib.train_state_shardings(cfg, tx, mesh))
    batch = mesh_lib.put_batch(mesh, rows)
    seq = "seq" if mesh.shape["seq"] > 1 else None
    assert tuple(batch["positions"].sharding.spec) == ("fsdp", None, seq)
    assert tuple(batch["visual_index"].sharding.spec) == ("fsdp", seq)
    got_state, got = update_lib.make_update_fn(cfg, loss, tx, mesh, **vl_step)(
        sharded, batch, jax.device_put(table, mesh_lib.replicated(mesh)))
    assert float(want["clip_frac_high"]) + float(want["clip_frac_low"]) > 0  # clipping is live
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "ratio_max"):
        assert abs(float(got[k]) - float(want[k])) <= 1e-5 * max(1.0, abs(float(want[k]))), k
    grads = lambda s: jax.tree.map(lambda a, b: a - np.asarray(b), before, s.params)  # noqa: E731
    flat_want = jax.tree_util.tree_flatten_with_path(grads(want_state))[0]
    for (path, g), (_, w) in zip(jax.tree_util.tree_flatten_with_path(grads(got_state))[0],
                                 flat_want):
        assert rel_err(g, w) < 1e-4, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- SP prefill

@pytest.mark.parametrize("attention,sizes", [("ring", {"fsdp": 2, "seq": 4}),
                                             pytest.param("ulysses", {"fsdp": 4, "seq": 2},
                                                          marks=pytest.mark.slow)])
def test_sp_prefill_writes_what_the_engine_prefill_writes(attention, sizes):
    """A video prompt (embeddings + M-RoPE) and a text prompt prefilled sequence-parallel:
    same pages, then the same greedy samples and log-probs as after the engine's prefill."""
    params = models.init_params(TEXT, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)  # varied samples
    ids, pos, _, _ = _video_prompt(range(9, 30))
    table = jax.random.normal(jax.random.key(3), (8, TEXT.d_model))
    embeds = vl.embed_tokens(TEXT, params, ids[None], table, vl.visual_index(VL, ids[None]))[0]
    text_ids = (np.arange(37) * 7 % 150).astype(np.int32)
    mesh = mesh_lib.make_mesh(sizes)
    cfg = TEXT.replace(attention=attention)
    params = jax.device_put(params, models.param_shardings(cfg, mesh))
    ecfg = EngineConfig(page_size=4, num_pages=64, max_slots=4, max_pages_per_slot=16,
                        sampling=SamplingParams(0.0))
    runs = []
    for prefill in (None, sp_prefill.make_prefill(mesh)):
        engine = Engine(cfg, ecfg, mesh)
        state = engine.init_decode_state()
        video, text = engine.reserve_prefix(ids, embeds, pos), engine.reserve_prefix(text_ids)
        state = (engine.run_prefill(params, state, [video, text]) if prefill is None
                 else prefill(engine, params, state, [video, text]))
        used = [layer * ecfg.num_pages + p for layer in range(TEXT.n_layers)
                for p in video.pages + text.pages]
        pages = np.asarray(state.k_pages)[:, used], np.asarray(state.v_pages)[:, used]
        state = engine.insert(video, state, [0, 1], max_new_tokens=6, last=True)
        state = engine.insert(text, state, [2], max_new_tokens=6, last=True)
        state, out = engine.generate(params, state, jax.random.key(0), num_steps=6)
        runs.append((pages, np.asarray(out.tokens)[:, :3], np.asarray(out.logps)[:, :3]))
    (want_pages, want_tok, want_lp), (got_pages, got_tok, got_lp) = runs
    for w, g in zip(want_pages, got_pages):
        np.testing.assert_allclose(g, w, atol=2e-5)
    np.testing.assert_array_equal(got_tok, want_tok)
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
    assert len(set(want_tok[:, 0].tolist())) > 1 and len(set(want_tok[:, 2].tolist())) > 1
    assert sp_prefill.bucket_length(37, 8) == 40 and sp_prefill.bucket_length(1000, 6) == 1056


# ----------------------------------------------------------------------------- the driver

@register("test_video_mesh_len")
def _length_reward(completion, answer, **meta):
    """Varies within a group, so that the update has a gradient."""
    return float(len(completion) % 3)


@pytest.mark.slow
def test_video_grpo_on_a_mesh_checkpoints_and_resumes(tmp_path, monkeypatch):
    c = config_from_file(os.path.join(CONFIGS, "video_synthetic.py"), "runlocal")
    c.mesh.update(fsdp=2, seq=2, tensor=2)
    c.model.attention = "ring"
    c.reward.spec = "video:1.0,test_video_mesh_len:0.5"
    c.checkpoint.every_steps = 1
    c.eval.update(every=2, num_prompts=2, k=2)
    seen = []
    batch_records = video_data.batch_records

    def recording(recs, step, n, seed, shuffle):
        seen.append(step)
        return batch_records(recs, step, n, seed, shuffle)

    monkeypatch.setattr(video_data, "batch_records", recording)
    m = loop.run(c, str(tmp_path))["grpo"]
    assert all(np.isfinite(x) for x in m.values())
    assert m["grad_norm"] > 0 and m["eval/pass@2"] >= m["eval/pass@1"] >= 0
    # Prompts prefilled sequence-parallel (ring over seq=2) and sampled by the engine: the
    # sampler's log-probs are the ring-sharded trainer's.
    assert m["rollout/sp_prefill"] == 1
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4
    assert m["vision/encoded_items"] == 2 and m["video/decoded"] == 2   # step 2: new videos
    c.rl.steps = 3
    m3 = loop.run(c, str(tmp_path))["grpo"]
    assert seen == [0, 1, 2] and np.isfinite(m3["loss"])
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]   # the held-out baseline as GRPO starts, then the steps
    assert sorted(os.listdir(tmp_path / "checkpoints"))[:2] == ["2", "3"]


@pytest.mark.slow
def test_video_qa_config_reports_missing_videos_and_bad_rows(tmp_path, caplog):
    clips = tmp_path / "clips"
    rows = []
    for i, answer in enumerate(["B", "green"]):
        rec = video_task.make_video_example("direction", 0, i, str(clips), num_frames=4,
                                            frame=56, size_px=8, speed=2)
        rows.append({"video": "clips/" + os.path.basename(rec["video"]),
                     "question": "Which colour moves?", "choices": ["red", "green", "blue"],
                     "answer": answer})
    (clips / "broken.mp4").write_bytes(b"\x00" * 2000)
    rows.insert(1, {"video": "clips/missing.mp4", "question": "q", "answer": "7"})
    rows.append({"video": "clips/broken.mp4", "question": "How many?", "answer": "3"})
    lines = [json.dumps(r) for r in rows] + ["{not json", json.dumps({"question": "no video"})]
    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(lines) + "\n")
    c = config_from_file(os.path.join(CONFIGS, "video_qa.py"), "runlocal")
    c.data.paths = str(data)
    c.rl.update(steps=1, prompts_per_step=3)   # one epoch: each row once
    c.reward.spec = "choice:1.0,test_video_mesh_len:0.5"
    c.rl.loss.kl_coef = 0.01   # reference log-probs from the sharded forward-only pass
    c.eval.every = 0
    fields = video_data.QAFields.of(build.options(c))
    recs, problems = video_data.load_video_qa(str(data), fields)
    assert [r["answer"] for r in recs] == ["B", "B", "3"]
    assert "C. blue" in recs[0]["prompt"] and recs[0]["prompt"].startswith(
        video_task.VIDEO_PROMPT)
    assert problems[0] == f"{data}:2: video file not found: {clips / 'missing.mp4'}"
    assert [p.split(": ")[0] for p in problems[1:]] == [f"{data}:5", f"{data}:6"]
    m = loop.run(c, str(tmp_path / "run"))["grpo"]
    assert str(clips / "missing.mp4") in caplog.text and f"{data}:5" in caplog.text
    assert str(clips / "broken.mp4") in caplog.text
    assert m["video/skipped"] == 1 and m["video/decoded"] == 2 and np.isfinite(m["loss"])
    assert m["pack/shared_frac"] == 1.0   # rl.shared_prompt="auto": video prompts, short answers
    assert abs(m["kl"]) < 1e-6     # the reference is the policy this (first) step updates
