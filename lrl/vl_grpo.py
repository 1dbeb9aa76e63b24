"""GRPO on videos: `run(config, workdir)` for `config.job == "grpo_video"`
(configs/video_synthetic.py).

One step, as lrl/loop.py's text step but with MR-SP stage 1 in front of it:
records -> decode each prompt's video (undecodable files are reported by path and skipped) ->
its visual embeddings, computed ONCE (`lrl.models.embed_cache`, in memory or on disk) into one
visual table -> prompt token embeddings with the table spliced in and M-RoPE positions ->
rollout (G samples per prompt prefilled from those embeddings) -> rewards -> advantages ->
packed rows carrying `visual_index` and [B, 3, T] positions -> `lrl.rl.update` steps that read
the same table. The vision tower is frozen; the text decoder is trained.

The policy is a tiny random Qwen2.5-VL, or a local HF Qwen2.5-VL directory. Without
`tokenizer.path`, the tokenizer is trained on the task's text (`lrl.data.tokenizer`) and gets
Qwen2.5-VL's vision tokens as added special tokens, with ids `vocab_size + i` in the order of
`VISION_TOKENS`: <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>.

Runs on one device (no mesh): sequence-parallel prefill and update are not wired here yet.

P prompts · G samples per prompt · B packed rows · T positions · D model width ·
R visual table rows.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import AddedToken

from lrl import experiment as ex
from lrl import grpo, models, rollout
from lrl.data import tokenizer as tok_lib
from lrl.data import video as video_lib
from lrl.data import video_task
from lrl.metrics import MetricsWriter
from lrl.models import embed_cache, vision, vl, vl_io
from lrl.rewards import video as _video_reward  # noqa: F401  (registers "video")
from lrl.rl import update as update_lib

log = logging.getLogger(__name__)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


# ----------------------------------------------------------------------------- set-up

def _task_corpus(seed: int):
    """Text the synthetic video prompts and answers are made of (tokenizer training)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(300):
        d = rng.choice(list(video_task.DIRECTIONS))
        colour = rng.choice(list(video_task.COLOURS))
        out.append(f"Which colour is the shape that moves {d}? Answer with \\boxed{{...}}. "
                   f"The {colour} shape moves {d}. \\boxed{{{colour}}}")
        n = int(rng.integers(0, 10))
        out.append(f"How many squares are in the video? Answer with \\boxed{{...}}. "
                   f"I count {n} squares and circles. \\boxed{{{n}}}")
    return out


def build_tokenizer(config, workdir: str):
    """A local tokenizer that knows the vision tokens, or one trained on the task's text with
    them added (saved under <workdir>/tokenizer)."""
    if config.tokenizer.path:
        tok = tok_lib.load_tokenizer(config.tokenizer.path)
    else:
        out = os.path.join(workdir, "tokenizer")
        if os.path.isfile(os.path.join(out, "tokenizer.json")):
            tok = tok_lib.load_tokenizer(out)
        else:
            tok = tok_lib.build_tokenizer(_task_corpus(config.seed), config.tokenizer.vocab_size)
            tok.add_tokens([AddedToken(t, special=True, normalized=False)
                            for t in VISION_TOKENS], special_tokens=True)
            tok.save_pretrained(out)
    missing = [t for t in VISION_TOKENS if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if missing:
        raise ValueError(f"tokenizer has no ids for the vision tokens {missing}")
    return tok


def build_policy(config, tokenizer):
    """-> (VLConfig, {"text": ..., "vision": ...}): a local checkpoint or a random init."""
    m = config.model
    dt = dict(dtype=ex.dtype(m.dtype), param_dtype=ex.dtype(m.param_dtype), remat="none")
    if m.hf_path:
        # compute dtype = parameter dtype here (load_hf_vl's `dtype` sets both)
        vl_cfg, params = vl_io.load_hf_vl(m.hf_path, dt["param_dtype"], remat="none")
        _check_token_ids(vl_cfg, tokenizer, m.hf_path)
        return vl_cfg, params
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = models.ModelConfig(
        model_type="qwen2", vocab_size=len(tokenizer), d_model=m.d_model, n_layers=m.n_layers,
        n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim,
        rope_theta=m.rope_theta, qkv_bias=True, mrope_section=tuple(m.mrope_section),
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,), **dt)
    vcfg = vision.VisionConfig(depth=m.vision_depth, hidden_size=m.vision_width,
                               intermediate_size=m.vision_mlp_dim, num_heads=m.vision_heads,
                               out_hidden_size=m.d_model, fullatt_block_indexes=(0,))
    vl_cfg = vl.VLConfig(text, vcfg, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"])
    k_text, k_vis = jax.random.split(jax.random.key(config.seed))
    return vl_cfg, {"text": models.init_params(text, k_text),
                    "vision": vision.init_vision_params(vcfg, k_vis)}


def _check_token_ids(vl_cfg, tokenizer, where: str) -> None:
    """The tokenizer's vision tokens must be the ids the checkpoint was trained with."""
    want = dict(zip(VISION_TOKENS, (vl_cfg.vision_start_token_id, vl_cfg.vision_end_token_id,
                                    vl_cfg.image_token_id, vl_cfg.video_token_id)))
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    if got != want or len(tokenizer) > vl_cfg.text.vocab_size:
        raise ValueError(f"tokenizer does not fit the model in {where}: vision token ids "
                         f"{got} vs the model's {want}; {len(tokenizer)} tokens for a "
                         f"vocabulary of {vl_cfg.text.vocab_size}")


def vision_settings(vl_cfg: vl.VLConfig, v) -> video_lib.VisionSettings:
    unit = (vl_cfg.vision.patch_size * vl_cfg.vision.spatial_merge_size) ** 2
    return video_lib.VisionSettings(
        patch_size=vl_cfg.vision.patch_size, temporal_patch_size=vl_cfg.vision.temporal_patch_size,
        merge_size=vl_cfg.vision.spatial_merge_size, num_frames=v.num_frames,
        video_min_pixels=v.min_tokens_per_frame * unit,
        video_max_pixels=v.max_tokens_per_frame * unit)


# ----------------------------------------------------------------------------- prompts

def visual_prompts(vl_cfg, text_params, tokenizer, records, items, table, offsets):
    """Per prompt: token ids [T] (the video pad expanded), M-RoPE positions [3, T], input
    embeddings [T, D] (table rows spliced in) and its visual token count."""
    out = []
    for rec, item, off in zip(records, items, offsets):
        ids = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        n = vl_cfg.tokens_per_item(item.grid_thw)
        ids = video_lib.expand_placeholders(np.asarray(ids, np.int32), vl_cfg.video_token_id,
                                            [n]).astype(np.int32)
        pos, delta = vl.mrope_positions(vl_cfg, ids, video_grids=[item.grid_thw],
                                        video_seconds_per_grid=[item.seconds_per_grid])
        index = vl.visual_index(vl_cfg, ids[None], None, np.array([[-1, off]]),
                                np.array([[0, n]]))
        embeds = vl.embed_tokens(vl_cfg.text, text_params, ids[None], table, index)[0]
        out.append(dict(ids=ids, positions=pos, delta=delta, embeds=embeds, count=n,
                        offset=int(off)))
    return out


def add_visual_rows(vl_cfg, batch, layout, prompts, group_size: int):
    """Packed text rows (`grpo.update_rows`) -> the same rows with `visual_index` [B, T] and
    M-RoPE `positions` [B, 3, T]: sequence i is sample i % G of prompt i // G, and every
    sample of a prompt reads that prompt's table rows."""
    B, T = batch["tokens"].shape
    seg = batch["segment_ids"]
    S = int(seg.max()) + 1
    pos = np.zeros((B, 3, T), np.int32)
    offsets, counts = np.full((B, S), -1, np.int32), np.zeros((B, S), np.int32)
    for i, (r, s) in enumerate(zip(layout["row"], layout["start"])):
        pr = prompts[i // group_size]
        n = int(layout["prompt_len"][i] + layout["completion_len"][i])
        pos[r, :, s:s + n] = vl.extend_positions(pr["positions"], pr["delta"], n)
        offsets[r, seg[r, s]], counts[r, seg[r, s]] = pr["offset"], pr["count"]
    out = dict(batch)
    out["positions"] = pos
    out["visual_index"] = vl.visual_index(vl_cfg, batch["tokens"], seg, offsets, counts)
    return out


# ----------------------------------------------------------------------------- the loop

def run(config, workdir: str) -> dict:
    """GRPO steps on the synthetic video task; returns the last step's metrics."""
    os.makedirs(workdir, exist_ok=True)
    v, rl_cfg = config.video, config.rl
    tokenizer = build_tokenizer(config, workdir)
    vl_cfg, params = build_policy(config, tokenizer)
    text_cfg = vl_cfg.text
    settings = vision_settings(vl_cfg, v)
    records = video_task.video_dataset(v.task, config.seed, v.size,
                                       os.path.join(workdir, "videos"),
                                       num_frames=v.frames_in_file, frame=v.frame)
    encoder = embed_cache.make_encoder(vl_cfg.vision)
    cache = embed_cache.EmbeddingCache(v.cache_dir or None)
    model_id = config.model.hf_path or f"random:{config.seed}"

    tx = ex.optimizer(config.optim, rl_cfg.steps)
    loss_cfg = ex.loss_config(config)
    state = update_lib.init_train_state(params["text"], tx)
    update_fn = update_lib.make_update_fn(text_cfg, loss_cfg, tx, num_micro=rl_cfg.micro_batches)
    plain = rl_cfg.temperature == 1.0 and rl_cfg.top_k == 0 and rl_cfg.top_p == 1.0
    needs_old = rl_cfg.epochs * rl_cfg.minibatches > 1 and not plain
    logp_fn = (jax.jit(functools.partial(update_lib.logprobs, model_cfg=text_cfg,
                                         num_micro=rl_cfg.micro_batches))
               if needs_old or loss_cfg.kl_coef else None)
    ref_params = jax.tree.map(lambda x: x.copy(), state.params) if loss_cfg.kl_coef else None
    eos_ids = text_cfg.eos_token_ids or (tokenizer.eos_token_id,)
    pool = ex.reward_pool(config)
    writer = MetricsWriter(workdir, rl_cfg.steps, tensorboard=config.metrics.tensorboard)
    P, G = rl_cfg.prompts_per_step, rl_cfg.group_size
    metrics = {}
    try:
        for step in range(rl_cfg.steps):
            t0 = time.time()
            recs = [records[(step * P + i) % len(records)] for i in range(P)]
            # Stage 1: decode, then encode each distinct video once (cache hits skip it).
            items, failures = video_lib.load_videos([r["video"] for r in recs], settings)
            bad = {path for path, _ in failures}
            recs = [r for r in recs if r["video"] not in bad]
            if not recs:
                raise RuntimeError(f"step {step}: every video failed to decode: {failures}")
            misses = cache.misses
            per_prompt = embed_cache.prompt_embeddings(
                vl_cfg.vision, params["vision"], [[it] for it in items], encoder, cache,
                settings.fingerprint(), model_id)
            table, offsets = embed_cache.build_table(per_prompt, text_cfg.d_model,
                                                     text_cfg.dtype, pad_to=256)
            prompts = visual_prompts(vl_cfg, state.params, tokenizer, recs, items, table,
                                     offsets)
            t_vision = time.time() - t0

            outs = rollout.generate(
                text_cfg, state.params, [p["ids"] for p in prompts],
                max_new_tokens=rl_cfg.max_new_tokens, num_samples=G,
                temperature=rl_cfg.temperature, top_k=rl_cfg.top_k, top_p=rl_cfg.top_p,
                eos_ids=eos_ids, seed=config.seed * 1_000_003 + step,
                page_size=config.rollout.page_size, max_slots=config.rollout.max_slots,
                pool_tokens=config.rollout.pool_tokens or None,
                prompt_embeds=[p["embeds"] for p in prompts],
                prompt_positions=[p["positions"] for p in prompts])
            completions = [np.asarray(t, np.int32) for per in outs for t, _ in per]
            truncated = np.array([len(c) >= rl_cfg.max_new_tokens and int(c[-1]) not in eos_ids
                                  for c in completions])
            groups = grpo.Groups([p["ids"] for p in prompts], [r["answer"] for r in recs],
                                 [dict(task=r["task"]) for r in recs], completions,
                                 [np.asarray(lp, np.float32) for per in outs for _, lp in per],
                                 G, truncated=truncated)
            m = grpo.score(groups, pool, tokenizer)
            m.update(grpo.rollout_metrics(groups, eos_ids))
            t_rollout = time.time() - t0 - t_vision

            weight = grpo.overlong_shaping(groups, rl_cfg)
            adv_PG = grpo.advantages(groups, rl_cfg.estimator)
            rows, layout = grpo.update_rows(
                groups, adv_PG, weight, row_len=rl_cfg.row_len,
                rows_multiple=rl_cfg.minibatches * rl_cfg.micro_batches,
                use_sampler_logp=plain)
            rows = add_visual_rows(vl_cfg, rows, layout, prompts, G)
            batch = {k: jnp.asarray(x) for k, x in rows.items()}
            if logp_fn is not None and needs_old:
                batch["old_logp"] = logp_fn(state.params, batch, table)
            if ref_params is not None:
                batch["ref_logp"] = logp_fn(ref_params, batch, table)
            t1 = time.time()
            um = None
            per = batch["tokens"].shape[0] // rl_cfg.minibatches
            for _ in range(rl_cfg.epochs):
                for i in range(rl_cfg.minibatches):
                    mb = jax.tree.map(lambda x: x[i * per:(i + 1) * per], batch)
                    state, um = update_fn(state, mb, table)
            m.update(jax.device_get(um))
            m.update({"time/vision_s": t_vision, "time/rollout_s": t_rollout,
                      "time/update_s": time.time() - t1,
                      "vision/encoded_items": cache.misses - misses,
                      "vision/table_rows": int(table.shape[0]),
                      "video/skipped": len(failures),
                      "advantage/abs_mean": float(np.abs(adv_PG).mean()),
                      "pack/rows": rows["tokens"].shape[0],
                      "pack/truncated": layout["num_truncated"]})
            metrics = writer.write(step + 1, m)
            writer.samples(step + 1, [
                {"prompt": recs[i // G]["prompt"], "completion": groups.texts[i],
                 "reward": float(groups.rewards_PG.flat[i]), "answer": recs[i // G]["answer"]}
                for i in range(min(config.metrics.samples_per_step, len(groups.texts)))])
        writer.plot("grpo")
    finally:
        pool.close()
        writer.close()
    return metrics
