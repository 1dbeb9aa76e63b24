"""GRPO on videos: `run(config, workdir)` for `config.job == "grpo_video"`
(configs/video_synthetic.py, configs/video_qa.py).

One step, as lrl/loop.py's text step with Long-RL's MR-SP in front of and inside it:
records -> stage 1 (`lrl.vl_data.encode_batch`): decode each prompt's video unless its
embedding is cached, encode each distinct video once with frames split over the mesh, one
visual table -> prompt embeddings with M-RoPE positions -> rollout (G samples per prompt; with
ring / Ulysses attention and a seq axis > 1 the prompts are prefilled sequence-parallel,
`lrl.rollout.sp_prefill`) -> rewards -> advantages -> packed rows carrying `visual_index` and
[B, 3, T] positions -> `lrl.rl.update` steps on the mesh (stage 2: each long row split along
T over `seq`, ring or Ulysses attention), reading the same table, replicated. The vision tower
is frozen; the text decoder is trained. Evaluation on held-out videos every `eval.every`
steps (mean reward, pass@1, pass@k); orbax checkpoints of the text train state (the vision
tower is rebuilt from the seed or `model.hf_path`), and a resumed run continues at the saved
step with the same data position (records are a pure function of the step).

The policy is a tiny random Qwen2.5-VL, or a local HF Qwen2.5-VL directory. One process
drives all local devices; multi-process video runs are not supported.

P prompts · G samples per prompt · B packed rows · T positions · D model width ·
R visual table rows.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from lrl import checkpoint as ckpt_lib
from lrl import experiment as ex
from lrl import grpo, models, rollout
from lrl import mesh as mesh_lib
from lrl import vl_data
from lrl.metrics import MetricsWriter
from lrl.models import embed_cache, vision, vl, vl_io
from lrl.models.config import ATTENTION_KINDS
from lrl.rewards import video as _video_reward  # noqa: F401  (registers "video")
from lrl.rl import update as update_lib
from lrl.rollout import sp_prefill

log = logging.getLogger(__name__)

VISION_TOKENS = vl_data.VISION_TOKENS
build_tokenizer = vl_data.build_tokenizer


# ----------------------------------------------------------------------------- set-up

def check_config(config) -> None:
    """Fails fast on values that would only break later."""
    m, rl_cfg, v = config.model, config.rl, config.video
    choices = {"video.source": (v.source, ("synthetic", "jsonl")),
               "model.attention": (m.attention, ATTENTION_KINDS)}
    for key, (value, valid) in choices.items():
        if value not in valid:
            raise ValueError(f"{key}={value!r}; choose one of {valid}")
    if rl_cfg.group_size < 2:
        raise ValueError(f"rl.group_size={rl_cfg.group_size}: GRPO needs at least 2 samples")
    if rl_cfg.logprob_chunk < 1:
        raise ValueError(f"rl.logprob_chunk={rl_cfg.logprob_chunk} must be >= 1")
    if config.eval.every and config.eval.k < 1:
        raise ValueError(f"eval.k={config.eval.k} must be >= 1")
    if v.source == "jsonl" and not config.data.paths:
        raise ValueError("video.source='jsonl' needs data.paths (a video-QA jsonl)")


def check_mesh(config, mesh) -> None:
    seq = mesh.shape["seq"]
    unit = sp_prefill.length_unit(config.model.attention, seq)
    if config.rl.row_len % unit:
        raise ValueError(f"rl.row_len={config.rl.row_len} must divide by {unit} for "
                         f"attention={config.model.attention!r} over seq={seq}")
    if jax.process_count() > 1:
        raise ValueError("grpo_video runs in one process over its local devices; "
                         "multi-process video GRPO is not supported")


def build_policy(config, tokenizer, mesh=None):
    """-> (VLConfig, {"text": ..., "vision": ...}): a local checkpoint or a random init, the
    text half sharded over `mesh` by lrl's rules, the vision half replicated."""
    m = config.model
    run_kw = dict(attention=m.attention, attention_impl=m.attention_impl or None,
                  remat=m.remat, param_shard_axes=ex.param_shard_axes(m.param_shard_axes))
    if m.hf_path:
        # load_hf_vl's dtype is the storage dtype (and its compute dtype): set compute after.
        vl_cfg, params = vl_io.load_hf_vl(m.hf_path, ex.dtype(m.param_dtype), mesh=mesh,
                                          **run_kw)
        vl_cfg = vl_cfg.replace(text=vl_cfg.text.replace(dtype=ex.dtype(m.dtype)))
        _check_token_ids(vl_cfg, tokenizer, m.hf_path)
        return vl_cfg, params
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = models.ModelConfig(
        model_type="qwen2", vocab_size=len(tokenizer), d_model=m.d_model, n_layers=m.n_layers,
        n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim,
        rope_theta=m.rope_theta, qkv_bias=True, mrope_section=tuple(m.mrope_section),
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,),
        dtype=ex.dtype(m.dtype), param_dtype=ex.dtype(m.param_dtype), **run_kw)
    vcfg = vision.VisionConfig(depth=m.vision_depth, hidden_size=m.vision_width,
                               intermediate_size=m.vision_mlp_dim, num_heads=m.vision_heads,
                               out_hidden_size=m.d_model, fullatt_block_indexes=(0,))
    vl_cfg = vl.VLConfig(text, vcfg, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"])
    k_text, k_vis = jax.random.split(jax.random.key(config.seed))
    # One compiled init, created replicated: the vision tower is small and every device
    # encodes frames with all of it.
    vis = jax.jit(vision.init_vision_params, static_argnums=0,
                  out_shardings=None if mesh is None else mesh_lib.replicated(mesh))(vcfg, k_vis)
    return vl_cfg, {"text": models.init_params(text, k_text, mesh), "vision": vis}


def _check_token_ids(vl_cfg, tokenizer, where: str) -> None:
    """The tokenizer's vision tokens must be the ids the checkpoint was trained with."""
    want = dict(zip(VISION_TOKENS, (vl_cfg.vision_start_token_id, vl_cfg.vision_end_token_id,
                                    vl_cfg.image_token_id, vl_cfg.video_token_id)))
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    if got != want or len(tokenizer) > vl_cfg.text.vocab_size:
        raise ValueError(f"tokenizer does not fit the model in {where}: vision token ids "
                         f"{got} vs the model's {want}; {len(tokenizer)} tokens for a "
                         f"vocabulary of {vl_cfg.text.vocab_size}")


# ----------------------------------------------------------------------------- compiled steps

def make_vl_update_fn(text_cfg, loss_cfg, tx, mesh=None, *, num_micro: int = 1,
                      chunk: int = 1024, fused_head: bool = True):
    """fn(state, batch, visual_table) -> (state, metrics): `update_step` jitted once, the state
    donated and kept in its sharding; the batch comes placed by `put_batch`, the table
    replicated (`put_table`)."""
    step = functools.partial(update_lib.update_step, model_cfg=text_cfg, loss_cfg=loss_cfg,
                             tx=tx, mesh=mesh, num_micro=num_micro, chunk=chunk,
                             fused_head=fused_head)
    if mesh is None:
        return jax.jit(step, donate_argnums=(0,))
    state_sh = update_lib.train_state_shardings(text_cfg, tx, mesh)
    return jax.jit(step, out_shardings=(state_sh, mesh_lib.replicated(mesh)),
                   donate_argnums=(0,))


def make_vl_logprobs_fn(text_cfg, mesh=None, *, num_micro: int = 1, chunk: int = 1024):
    """fn(params, batch, visual_table) -> logp_BT: old or reference log-probs."""
    fn = functools.partial(update_lib.logprobs, model_cfg=text_cfg, mesh=mesh,
                           num_micro=num_micro, chunk=chunk)
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=mesh_lib.batch_sharding(mesh, 2))


def put_batch(mesh, rows: dict) -> dict:
    """Host rows -> device arrays, [B, T] and [B, 3, T] alike split along T over seq."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in rows.items()}
    return jax.device_put({k: np.asarray(v) for k, v in rows.items()},
                          vl.batch_shardings(mesh, rows))


def put_table(mesh, table):
    return table if mesh is None else jax.device_put(table, mesh_lib.replicated(mesh))


# ----------------------------------------------------------------------------- rollouts

@dataclasses.dataclass
class Run:
    """What every step needs; built once from the config."""
    config: object
    mesh: object
    vl_cfg: vl.VLConfig
    tokenizer: object
    vision_params: object
    stage: vl_data.VisionStage
    pool: object
    prefill_fn: object = None    # sequence-parallel prefill, or None
    update_fn: object = None     # make_vl_update_fn
    logp_fn: object = None       # make_vl_logprobs_fn, when old or reference log-probs are needed
    needs_old: bool = False      # old log-probs from a trainer forward
    sampler_logp: bool = False   # old log-probs are the sampler's (plain temperature-1 sampling)

    @property
    def eos_ids(self):
        return self.vl_cfg.text.eos_token_ids or (self.tokenizer.eos_token_id,)


def rollout_groups(r: Run, params, recs, G: int, temperature: float, seed: int):
    """Stage 1, prompts, G samples each and their rewards -> (records kept, prompts, Groups,
    visual table, metrics). Videos that do not decode, and prompts that do not fit a packed
    row (`rl.row_len`) with their completions, are reported and dropped."""
    rl_cfg = r.config.rl
    t0 = time.time()
    recs, items, table, offsets, m = vl_data.encode_batch(r.stage, r.vision_params, recs)
    prompts = vl_data.visual_prompts(r.vl_cfg, params, r.tokenizer, recs, items, table, offsets)
    fits = [len(p["ids"]) + rl_cfg.max_new_tokens <= rl_cfg.row_len for p in prompts]
    for rec, p, ok in zip(recs, prompts, fits):
        if not ok:
            log.warning("skipping %s: its prompt has %d tokens; with %d new tokens it does not "
                        "fit rl.row_len=%d", rec["video"], len(p["ids"]), rl_cfg.max_new_tokens,
                        rl_cfg.row_len)
    recs = [x for x, ok in zip(recs, fits) if ok]
    prompts = [x for x, ok in zip(prompts, fits) if ok]
    if not recs:
        raise RuntimeError("no prompt of this batch could be used (see the warnings above)")
    m["video/too_long"] = len(fits) - len(recs)
    m["time/vision_s"] = time.time() - t0
    stats, kw = {}, {}
    if r.prefill_fn is not None:
        kw["prefill_fn"] = r.prefill_fn
    outs = rollout.generate(
        r.vl_cfg.text, params, [p["ids"] for p in prompts], max_new_tokens=rl_cfg.max_new_tokens,
        num_samples=G, temperature=temperature, top_k=rl_cfg.top_k, top_p=rl_cfg.top_p,
        eos_ids=r.eos_ids, seed=seed, page_size=r.config.rollout.page_size,
        max_slots=r.config.rollout.max_slots, pool_tokens=r.config.rollout.pool_tokens or None,
        mesh=r.mesh, stats=stats, prompt_embeds=[p["embeds"] for p in prompts],
        prompt_positions=[p["positions"] for p in prompts], **kw)
    completions = [np.asarray(t, np.int32) for per in outs for t, _ in per]
    truncated = np.array([len(c) >= rl_cfg.max_new_tokens and int(c[-1]) not in r.eos_ids
                          for c in completions])
    groups = grpo.Groups([p["ids"] for p in prompts], [x["answer"] for x in recs],
                         [dict(task=x["task"]) for x in recs], completions,
                         [np.asarray(lp, np.float32) for per in outs for _, lp in per],
                         G, truncated=truncated)
    m.update(grpo.score(groups, r.pool, r.tokenizer))
    m.update(grpo.rollout_metrics(groups, r.eos_ids))
    m.update({"rollout/prefill_s": stats["prefill_s"], "rollout/decode_s": stats["decode_s"],
              "rollout/sp_prefill": float("prefill_fn" in kw),
              "time/rollout_s": time.time() - t0 - m["time/vision_s"]})
    return recs, prompts, groups, table, m


def evaluate(r: Run, params, held_out, step: int) -> dict:
    """Held-out videos, eval.k samples each: mean reward, pass@1 and pass@k."""
    e = r.config.eval
    _, _, groups, _, _ = rollout_groups(r, params, held_out, e.k, e.temperature,
                                        seed=10_007 * step)
    correct = groups.rewards_PG >= 1.0
    return {"eval/reward/mean": float(groups.rewards_PG.mean()),
            "eval/pass@1": grpo.pass_at_k(correct, 1),
            f"eval/pass@{e.k}": grpo.pass_at_k(correct, e.k)}


# ----------------------------------------------------------------------------- the loop

def _restore(ckpt, text_cfg, tx, mesh):
    got = ckpt.restore(update_lib.abstract_train_state(text_cfg, tx, mesh))
    if got is not None:
        log.info("resumed from %s (step %d)", got.path, got.step)
    return got


def grpo_step(r: Run, state, ref_params, train, step: int):
    """One GRPO step (rollout, rewards, advantages, packing, updates) -> (state, metrics,
    records, groups)."""
    config, rl_cfg, mesh = r.config, r.config.rl, r.mesh
    P, G = rl_cfg.prompts_per_step, rl_cfg.group_size
    recs = vl_data.batch_records(train, step, P, config.seed,
                                 shuffle=config.video.source != "synthetic")
    recs, prompts, groups, table, m = rollout_groups(r, state.params, recs, G, rl_cfg.temperature,
                                                     seed=config.seed * 1_000_003 + step)
    weight = grpo.overlong_shaping(groups, rl_cfg)
    adv_PG = grpo.advantages(groups, rl_cfg.estimator)
    rows, layout = grpo.update_rows(
        groups, adv_PG, weight, row_len=rl_cfg.row_len,
        rows_multiple=rl_cfg.minibatches * rl_cfg.micro_batches * ex.data_shards(mesh),
        use_sampler_logp=r.sampler_logp)
    rows = vl_data.add_visual_rows(r.vl_cfg, rows, layout, prompts, G)
    table = put_table(mesh, table)
    per = rows["tokens"].shape[0] // rl_cfg.minibatches
    batches = [put_batch(mesh, {k: x[i * per:(i + 1) * per] for k, x in rows.items()})
               for i in range(rl_cfg.minibatches)]
    for batch in batches:   # old / reference log-probs before any update of this step
        if r.needs_old:
            batch["old_logp"] = r.logp_fn(state.params, batch, table)
        if ref_params is not None:
            batch["ref_logp"] = r.logp_fn(ref_params, batch, table)
    t1 = time.time()
    for _ in range(rl_cfg.epochs):
        for batch in batches:
            state, um = r.update_fn(state, batch, table)
    m.update(jax.device_get(um))
    m.update({"time/update_s": time.time() - t1,
              "advantage/abs_mean": float(np.abs(adv_PG).mean()),
              "pack/rows": rows["tokens"].shape[0], "pack/truncated": layout["num_truncated"]})
    return state, m, recs, groups


def _initial_state(ckpt, text_cfg, tx, mesh, params, stage):
    """-> (train state, steps done): the newest readable checkpoint, or a fresh state."""
    got = _restore(ckpt, text_cfg, tx, mesh)
    if got is not None:
        stage.bad.update(got.data_state.get("bad_videos", {}))
        return got.state, int(got.data_state["step"])
    state = update_lib.TrainState(np.zeros((), np.int32), params, tx.init(params))
    return jax.device_put(state, update_lib.train_state_shardings(text_cfg, tx, mesh)), 0


def run(config, workdir: str) -> dict:
    """GRPO steps on videos; returns the last step's metrics."""
    check_config(config)
    os.makedirs(workdir, exist_ok=True)
    mesh = ex.build_mesh(config)
    check_mesh(config, mesh)
    rl_cfg, v = config.rl, config.video
    train = vl_data.records(config, workdir)
    tokenizer = build_tokenizer(config, workdir, train)
    vl_cfg, params = build_policy(config, tokenizer, mesh)
    text_cfg = vl_cfg.text
    held_out = vl_data.records(config, workdir, "eval") if config.eval.every else []
    axes = tuple(a for a in v.frame_axes.split(",") if a) or None
    stage = vl_data.VisionStage(
        vl_cfg, vl_data.vision_settings(vl_cfg, v),
        embed_cache.make_encoder(vl_cfg.vision, mesh, frame_axes=axes),
        embed_cache.EmbeddingCache(v.cache_dir or None),
        config.model.hf_path or f"random:{config.seed}")
    sp = config.model.attention != "dense" and mesh.shape["seq"] > 1
    tx = ex.optimizer(config.optim, rl_cfg.steps)
    loss_cfg = ex.loss_config(config)
    # Sampler log-probs equal the trainer's only for plain temperature-1 sampling.
    plain = rl_cfg.temperature == 1.0 and rl_cfg.top_k == 0 and rl_cfg.top_p == 1.0
    needs_old = rl_cfg.epochs * rl_cfg.minibatches > 1 and not plain
    c = config.checkpoint
    metrics = {}
    with ckpt_lib.PreemptionGuard() as guard, ckpt_lib.CheckpointManager(
            os.path.join(workdir, "checkpoints"), keep=c.keep, every_steps=c.every_steps,
            every_minutes=c.every_minutes) as ckpt:
        ckpt.save_tokenizer(tokenizer)
        state, step = _initial_state(ckpt, text_cfg, tx, mesh, params["text"], stage)
        # The frozen reference: the policy as this run starts.
        ref_params = jax.tree.map(lambda x: x.copy(), state.params) if loss_cfg.kl_coef else None
        r = Run(config, mesh, vl_cfg, tokenizer, params["vision"], stage, ex.reward_pool(config),
                prefill_fn=(sp_prefill.make_prefill(mesh, config.rollout.sp_min_tokens)
                            if sp else None),
                update_fn=make_vl_update_fn(text_cfg, loss_cfg, tx, mesh,
                                            num_micro=rl_cfg.micro_batches,
                                            chunk=rl_cfg.logprob_chunk,
                                            fused_head=rl_cfg.fused_head),
                logp_fn=(make_vl_logprobs_fn(text_cfg, mesh, num_micro=rl_cfg.micro_batches,
                                             chunk=rl_cfg.logprob_chunk)
                         if needs_old or loss_cfg.kl_coef else None),
                needs_old=needs_old, sampler_logp=plain)
        del params
        writer = MetricsWriter(workdir, rl_cfg.steps, tensorboard=config.metrics.tensorboard)
        writer.resume(step, "grpo" if step else None)  # cut rows logged after the checkpoint
        G = rl_cfg.group_size
        try:
            while step < rl_cfg.steps:
                state, m, recs, groups = grpo_step(r, state, ref_params, train, step)
                step += 1
                if held_out and (step % config.eval.every == 0 or step == rl_cfg.steps):
                    m.update(evaluate(r, state.params, held_out, step))
                metrics = writer.write(step, m)
                writer.samples(step, [
                    {"prompt": recs[i // G]["prompt"], "completion": groups.texts[i],
                     "reward": float(groups.rewards_PG.flat[i]), "answer": recs[i // G]["answer"]}
                    for i in range(min(config.metrics.samples_per_step, len(groups.texts)))])
                stopped = guard.should_stop(step)
                if stopped or step == rl_cfg.steps or ckpt.should_save(step):
                    ckpt.save(step, state, data_state={"phase": "grpo_video", "step": step,
                                                       "bad_videos": dict(stage.bad)},
                              config=config.to_dict(), model_config=text_cfg)
                if stopped:
                    log.info("stopping at step %d on request (SIGTERM); checkpoint saved", step)
                    break
            writer.plot("grpo")
        finally:
            r.pool.close()
            writer.close()
    return metrics
