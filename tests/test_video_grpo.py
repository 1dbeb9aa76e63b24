"""Video GRPO end to end: the rollout prefills multimodal prompts from embeddings with M-RoPE
positions (and agrees with the full forward), and a few GRPO steps of the synthetic video
task run through `lrl.loop.run`, encoding each video once however many samples read it."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from lrl import loop, models, rollout
from lrl.data import video_task
from lrl.models import embed_cache, vision, vl
from lrl.rewards import register
from lrl.rewards.video import video_reward


def _config(arg=None):
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "video_synthetic.py")
    spec = importlib.util.spec_from_file_location("video_synthetic", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def test_video_reward():
    assert video_reward("it is \\boxed{blue}, no: \\boxed{ Red }", "red") == 1.0
    assert video_reward("\\boxed{3}", "3") == 1.0
    assert video_reward("\\boxed{red shape}", "red") == 0.0
    assert video_reward("red", "red") == 0.0
    assert video_reward("\\boxed{03}", "3") == 0.0


@pytest.mark.optimized
def test_rollout_of_a_video_prompt_matches_the_forward():
    """Greedy samples from embeddings + M-RoPE prefill and `length + delta` decode positions
    equal the argmax (and log-probs) of the full multimodal forward over prompt + sample."""
    text = models.ModelConfig(model_type="qwen2", vocab_size=160, d_model=64, n_layers=2,
                              n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=96, qkv_bias=True,
                              mrope_section=(2, 3, 3), remat="none")
    vcfg = vision.VisionConfig(depth=1, out_hidden_size=64)
    c = vl.VLConfig(text, vcfg, image_token_id=150, video_token_id=151,
                    vision_start_token_id=152, vision_end_token_id=153)
    tp = models.init_params(text, jax.random.key(0))
    # Larger weights than the init so that greedy decoding is not one repeated token.
    tp = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, tp)
    vp = vision.init_vision_params(vcfg, jax.random.key(1))
    grid = (2, 4, 4)
    patches = np.random.RandomState(0).randn(32, vcfg.patch_dim).astype(np.float32)
    emb = vision.encode(vcfg, vp, patches, grid)
    n = c.tokens_per_item(grid)
    prompt = np.array([3, 152] + [151] * n + [153, 9, 10], np.int32)
    pos, delta = vl.mrope_positions(c, prompt, video_grids=[grid])
    assert delta != 0
    index = vl.visual_index(c, prompt[None])
    embeds = vl.embed_tokens(text, tp, prompt[None], emb, index)[0]
    new = 6
    outs = rollout.generate(text, tp, [prompt], max_new_tokens=new, num_samples=2,
                            temperature=0.0, page_size=4, prompt_embeds=[embeds],
                            prompt_positions=[pos])
    (toks, logps), (toks2, _) = outs[0]
    np.testing.assert_array_equal(toks, toks2)
    # A prompt longer than one prefill chunk: later chunks attend to the pages already
    # written, or (whole_prefill) the whole prompt goes in one call.
    for whole in (False, True):
        chunked = rollout.generate(text, tp, [prompt], max_new_tokens=new, temperature=0.0,
                                   page_size=4, prefill_chunk=4, whole_prefill=whole,
                                   prompt_embeds=[embeds], prompt_positions=[pos])[0][0]
        np.testing.assert_array_equal(chunked[0], toks)
        np.testing.assert_allclose(chunked[1], logps, atol=1e-5)
    assert len(set(toks.tolist())) > 1
    full = np.concatenate([prompt, toks])
    full_pos = vl.extend_positions(pos, delta, len(full))
    full_index = vl.visual_index(c, full[None], None, np.array([[-1, 0]]), np.array([[0, n]]))
    logits = vl.vl_forward(text, tp, full[None], full_pos[:, None], None, emb,
                           full_index)[0]
    T = len(prompt)
    lp = jax.nn.log_softmax(logits[T - 1:T - 1 + new], axis=-1)
    np.testing.assert_array_equal(np.argmax(lp, -1), toks)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(lp), toks[:, None], 1)[:, 0],
                               logps, atol=1e-4)
    # Text positions instead of M-RoPE would change the samples' log-probs.
    text_logits = vl.vl_forward(text, tp, full[None], None, None, emb,
                                full_index)[0]
    assert not np.allclose(np.asarray(text_logits[T - 1:T - 1 + new]),
                           np.asarray(logits[T - 1:T - 1 + new]), atol=1e-3)


@register("test_video_len")
def _length_reward(completion, answer, **meta):
    """Varies within a group (a random policy never answers right), so advantages are not
    all zero and the update has a gradient."""
    return float(len(completion) % 3)


@pytest.mark.slow
def test_video_grpo_steps_end_to_end(tmp_path, monkeypatch, caplog):
    c = _config("runlocal")
    c.reward.spec = "video:1.0,test_video_len:0.5"
    c.rl.steps, c.rl.prompts_per_step, c.rl.group_size = 2, 2, 4
    c.eval.every = 0    # the held-out videos would add encoder calls (test_video_mesh runs eval)
    v = c.video
    # Video 3 (the second step's second prompt) is garbage: reported by path and skipped.
    videos = tmp_path / "videos"
    videos.mkdir()
    bad = videos / f"video_{c.data.task}_{c.seed}_3_{v.frames_in_file}x{v.frame}.mp4"
    bad.write_bytes(np.random.RandomState(0).bytes(3000))
    calls = {"calls": 0, "frames": 0}
    make = embed_cache.make_encoder

    def counting_encoder(*args, **kwargs):
        enc = make(*args, **kwargs)

        def run(params, patches, grid):
            calls["calls"] += 1
            calls["frames"] += patches.shape[0]
            return enc(params, patches, grid)
        return run

    monkeypatch.setattr(embed_cache, "make_encoder", counting_encoder)
    m = loop.run(c, str(tmp_path))["grpo"]
    assert str(bad) in caplog.text
    assert m["video/skipped"] == 1 and m["vision/encoded_items"] == 1
    # 3 decodable videos x 2 temporal patches, one tower call per step, for 12 rollout rows.
    t = v.num_frames // 2
    assert calls == {"calls": 2, "frames": 3 * t}
    assert all(np.isfinite(x) for x in m.values())
    assert m["grad_norm"] > 0 and m["reward/std"] > 0
    # The sampler's log-probs (multimodal prefill, delta decode) are the trainer's.
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4
    assert m["response/length_mean"] > 0
    recs = video_task.video_dataset(c.data.task, c.seed, 3, str(videos),
                                    num_frames=v.frames_in_file, frame=v.frame)
    assert all(os.path.isfile(r["video"]) for r in recs)


@pytest.mark.slow
def test_video_grpo_from_a_local_hf_checkpoint(tmp_path):
    """model.hf_path: a (tiny, random) transformers Qwen2.5-VL directory and its tokenizer."""
    import pytest
    import torch
    import transformers

    from lrl import build
    from lrl.tasks import video, video_data
    c = _config("runlocal")
    tok = video_data.build_tokenizer(build.options(c), str(tmp_path / "trained"))
    ids = {t: tok.convert_tokens_to_ids(t) for t in video_data.VISION_TOKENS}
    hf_cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=tok.eos_token_id),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, window_size=56, fullatt_block_indexes=[0],
                           tokens_per_second=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(hf_cfg).float().save_pretrained(
        str(tmp_path / "hf"))
    c.model.hf_path = str(tmp_path / "hf")
    c.tokenizer.path = str(tmp_path / "trained" / "tokenizer")
    c.rl.steps, c.optim.warmup_steps, c.eval.every = 1, 1, 0
    m = loop.run(c, str(tmp_path / "run"))["grpo"]
    assert m["vision/encoded_items"] == c.rl.prompts_per_step
    assert all(np.isfinite(x) for x in m.values())
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4
    vl_cfg, _ = video.build_policy(build.options(c), tok)
    with pytest.raises(ValueError, match="vision token ids"):
        video.check_token_ids(vl_cfg.replace(video_token_id=5), tok, "here")
