"""The one experiment loop, for every job and task: an optional SFT warm start (text), then
GRPO steps (text or video), with held-out evaluation, checkpoints (resumable, SIGTERM-safe)
and metrics. `run(config, workdir)` is what `python -m lrl.main` calls.

The config is read once, into typed options (`lrl.options`); what differs between text and
video is the task (`lrl.tasks`); one GRPO step's host half is `lrl.grpo.step`, or with
`pipeline.rollout_devices` `lrl.pipeline.step` (the rollout a step ahead on its own mesh). The
jitted programs are built here, once per phase.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable, Optional

import jax
import numpy as np

from lrl import checkpoint as ckpt_lib
from lrl import compile_cache
from lrl import console
from lrl import distributed
from lrl import errors
from lrl import experiment as ex
from lrl import grpo, ppo, step_setup, tasks, wandb_sink
from lrl.groups import Groups
from lrl import pipeline as pipeline_lib
from lrl import preflight
from lrl import mesh as mesh_lib
from lrl import options as options_lib
from lrl.metrics import MetricsWriter
from lrl.models import flash as flash_lib
from lrl.options import as_dict
from lrl.rl import budget as budget_lib
from lrl.rl import train as train_lib
from lrl.rl import update as update_lib
from lrl.rl.sft import make_sft_fn
from lrl import rollout as rollout_lib
from lrl.rollout import pages as pages_lib
from lrl.rollout import partial as partial_lib
from lrl.rollout import sp_prefill
from lrl.rollout import weights as weights_lib
from lrl.rollout.pages import pages_for

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """What every phase needs; built once from the options."""
    opts: object
    config: dict                  # the config as plain data, saved with each checkpoint
    workdir: str
    mesh: object
    task: object
    ckpt: ckpt_lib.CheckpointManager
    guard: ckpt_lib.PreemptionGuard
    writer: MetricsWriter
    rollout_mesh: object = None   # the one-step-off pipeline's (`lrl.pipeline`), else None
    cache: compile_cache.Cache = dataclasses.field(   # programs and budgets kept on disk
        default_factory=lambda: compile_cache.Cache(None))

    @property
    def eos_ids(self) -> tuple:
        cfg, tok = self.task.model_cfg, self.task.tokenizer
        return tuple(int(e) for e in (cfg.eos_token_ids or (tok.eos_token_id,)))


def run(config, workdir: str, started=None) -> dict:
    """Runs the configured job; returns the last metrics of each phase. `started`: what
    `preflight.start(config, workdir)` returned, when the caller ran it already."""
    # Every file the run reads checked, before anything is written to the workdir.
    opts, mesh, rollout_mesh = started or preflight.start(config, workdir)
    os.makedirs(workdir, exist_ok=True)
    with compile_cache.enabled(compile_cache.folder(opts.compile_cache, workdir)) as cache:
        return _run(opts, config, workdir, cache, mesh, rollout_mesh)


def _run(opts, config, workdir: str, cache: compile_cache.Cache, mesh, rollout_mesh) -> dict:
    task = tasks.build(opts, workdir, mesh)
    console.banner(opts, workdir, mesh, task.model_cfg)
    c = opts.checkpoint
    with ckpt_lib.PreemptionGuard() as guard, ckpt_lib.CheckpointManager(
            os.path.join(workdir, "checkpoints"), keep=c.keep, every_steps=c.every_steps,
            every_minutes=c.every_minutes) as ckpt:
        ckpt.save_tokenizer(task.tokenizer)
        wb = wandb_sink.settings(opts.metrics)
        writer = MetricsWriter(workdir, opts.sft.steps + opts.rl_steps,
                               tensorboard=opts.metrics.tensorboard,
                               sink=wandb_sink.Sink(wb, workdir, as_dict(config))
                               if wb and console.primary() else None,
                               phases={"sft": opts.sft.steps, "grpo": opts.rl_steps})
        r = Run(opts, as_dict(config), workdir, mesh, task, ckpt, guard, writer, rollout_mesh,
                cache)
        try:
            out = _run_phases(r)
        finally:
            writer.close()
    writer.summary()  # after the checkpoint manager has committed the last save
    return out


def _run_phases(r: Run) -> dict:
    opts = r.opts
    sft_steps, rl_steps = opts.sft.steps, opts.rl_steps
    sft_tx = ex.optimizer(opts.optim, sft_steps, lr=opts.sft.lr,
                          warmup=opts.sft.warmup_steps) if sft_steps else None
    rl_tx = ex.optimizer(opts.optim, rl_steps) if rl_steps else sft_tx
    # Both phases use the same optimizer structure (only the schedules differ), so one
    # abstract state restores either phase's checkpoint.
    # PPO's critic and the frozen reference are saved as items of their own; read where a
    # step has them (an SFT step has neither).
    abstract = train_lib.abstract_train_state(r.task.model_cfg, rl_tx, r.mesh)
    trees = {}
    if rl_steps and opts.rl.uses_critic:
        trees["critic"] = ppo.abstract_critic(opts, r.task.model_cfg, r.mesh)
    if rl_steps and (opts.rl.loss.kl_coef or opts.rl.kl_in_reward):
        trees["reference"] = abstract.params
    restored = r.ckpt.restore(abstract, trees=trees)
    if restored is not None:
        log.info("resumed from %s (step %d, phase %s)", restored.path, restored.step,
                 restored.data_state.get("phase"))
        r.task.restore(restored.data_state.get("task", {}))
    # Rows logged after the restored checkpoint by a run that died are logged again: cut them.
    r.writer.resume(restored.step if restored else 0,
                    restored.data_state["phase"] if restored else None)
    phase = restored.data_state["phase"] if restored else ("sft" if sft_steps else "grpo")
    state = restored.state if restored else None
    data_state = restored.data_state if restored else {}
    out = {}
    if phase == "sft" and sft_steps:
        if state is None:
            state = _fresh_state(r, r.task.initial_params(), sft_tx)
        state, out["sft"], stopped = sft_phase(r, state, sft_tx, sft_steps, data_state)
        if stopped or not rl_steps:
            return out
        data_state = {}
        state = _fresh_state(r, state.params, rl_tx)
    elif state is None:
        state = _fresh_state(r, r.task.initial_params(), rl_tx)
    if rl_steps:
        saved = restored.trees if restored and phase == "grpo" else {}
        out["grpo"] = grpo_phase(r, state, rl_tx, sft_steps, rl_steps, data_state,
                                 restored.path if restored else "", saved)
    return out


def _fresh_state(r: Run, params, tx):
    """A phase starts its own optimizer (and step count) on the params it is given."""
    state = train_lib.TrainState(np.zeros((), np.int32), params, tx.init(params))
    return jax.device_put(state, train_lib.train_state_shardings(r.task.model_cfg, tx, r.mesh))


def _checkpoint(r: Run, step: int, state, data_state: Callable[[], dict],
                force: bool = False, trees: Optional[dict] = None):
    """`data_state` is called only when this step saves: with partial rollouts it serializes
    every carried sample, work a step that saves nothing should not do. `trees`: further
    states saved beside (PPO's critic)."""
    if force or r.ckpt.should_save(step):
        r.ckpt.save(step, state, data_state={**data_state(), "task": r.task.state()},
                    config=r.config, model_config=r.task.model_cfg, trees=trees)


# ----------------------------------------------------------------------------- SFT

def sft_phase(r: Run, state, tx, steps: int, data_state: dict):
    it = r.task.sft_batches()
    if data_state.get("sft_iter"):
        it.set_state(data_state["sft_iter"])
    step_fn = make_sft_fn(r.task.model_cfg, tx, r.mesh)
    step = int(jax.device_get(state.step))
    r.writer.begin_phase("sft", step, r.opts)
    metrics, stopped = {}, False
    while step < steps:
        batch = next(it)
        arrays = {k: batch[k] for k in ("tokens", "positions", "segment_ids", "targets",
                                        "loss_mask")}
        state, m = step_fn(state, mesh_lib.put_batch(r.mesh, arrays))
        step += 1
        metrics = r.writer.write(step, jax.device_get(m), phase="sft")
        distributed.beat(f"sft step {step}")
        stopped = r.guard.should_stop(step)
        _checkpoint(r, step, state, lambda: {"phase": "sft", "sft_iter": it.get_state()},
                    force=stopped or step == steps)
        if stopped:
            break
    r.writer.plot("sft")
    return state, metrics, stopped


# ----------------------------------------------------------------------------- GRPO

def with_update_runs(cfg, row_len: int, shared_group: int = 0):
    """`cfg` with the runs a row of `row_len` tokens may hold on cuDNN's packed attention
    (`flash.segments_for`); a shared group of `shared_group` responses (0: none), its prefix
    and the padding fit a row at least."""
    least = shared_group + 2 if shared_group else 2
    return cfg.replace(max_segments=flash_lib.segments_for(row_len, cfg.n_heads, cfg.head_dim,
                                                           least=least))


def update_model_config(cfg, rl_, sizes: dict):
    """The model config the update (and its log-prob pass) runs: `with_update_runs` for the
    rows' length, which is fixed before memory sets how many rows a micro-batch holds
    (`budget.smallest_shape`), and the groups `rl.shared_prompt` may share."""
    return with_update_runs(cfg, budget_lib.smallest_shape(**sizes)[1],
                            0 if rl_.shared_prompt == "off" else rl_.group_size)


def build_grpo(r: Run, state, tx, pool, critic_state=None,
               ppo_saved: Optional[dict] = None, reference=None) -> step_setup.Setup:
    """The GRPO step's compiled programs and fixed inputs, built once for the phase: the
    update for the micro-batch shapes (its token budget from the config or from device
    memory, shorter rows for a minibatch's last ones), the old / reference log-prob pass,
    the sequence-parallel prefill; with `rl.needs_ppo_pass` PPO's part (`lrl.ppo`: the
    critic, restored as `critic_state` or made from the policy, and the KL in the reward,
    its coefficient from `ppo_saved`). `reference`: the frozen reference a checkpoint kept
    (else the policy as the phase starts)."""
    opts, task, mesh = r.opts, r.task, r.mesh
    rl_ = opts.rl
    loss_cfg = ex.loss_config(opts)
    sizes = dict(row_len=rl_.row_len, max_tokens=rl_.max_tokens_per_micro,
                 longest=options_lib.longest_sample(opts),
                 unit=sp_prefill.length_unit(opts.model.attention, mesh.shape["seq"]))
    cfg = update_model_config(task.model_cfg, rl_, sizes)
    kw = dict(chunk=rl_.logprob_chunk, hidden=task.hidden, extra_keys=task.extra_keys)
    update = update_lib.make_update_programs(cfg, loss_cfg, tx, mesh,
                                             fused_head=rl_.fused_head, **kw)
    shards = ex.data_shards(mesh)
    kl = bool(loss_cfg.kl_coef)
    # The frozen reference (the policy as this phase starts), made first: it takes memory.
    ref = kl or rl_.kl_in_reward
    ref_params = None
    if ref:
        ref_params = (reference if reference is not None
                      else jax.tree.map(lambda x: x.copy(), state.params))
    # So is PPO's critic (its params and optimizer state): the budget below is what the
    # actor, the reference and the critic leave, and a micro-batch fits both updates.
    p = _build_ppo(r, cfg, state, critic_state, ppo_saved, loss_cfg, kw)
    memory = budget_lib.device_memory(jax.local_devices()[0])

    def spec(rows_per_shard, row_len):
        return grpo.micro_batch_spec(rl_, task, mesh, shards * rows_per_shard, row_len, kl)

    @functools.lru_cache(maxsize=None)   # compiled once: the same accumulator for every shape
    def apply_need():
        least = spec(*budget_lib.smallest_shape(**sizes))
        need_ = update_lib.apply_bytes(update, state, least, task.extra_spec())
        if p is not None and p.critic is not None:
            need_ = max(need_, update_lib.apply_bytes(p.critic, p.state, _critic_spec(least),
                                                      task.extra_spec()))
        return need_

    @functools.lru_cache(maxsize=None)   # each shape compiled once, whoever asks
    def need(rows_per_shard, row_len):
        # The accumulator lives through both programs; the optimizer step may need more.
        try:
            acc_need = update_lib.need_bytes(update, state.params,
                                             spec(rows_per_shard, row_len), task.extra_spec())
            if p is not None and p.critic is not None:   # the critic's update, same rows
                acc_need = max(acc_need, update_lib.need_bytes(
                    p.critic, p.state.params, _critic_spec(spec(rows_per_shard, row_len)),
                    task.extra_spec()))
        except jax.errors.JaxRuntimeError as e:
            if not budget_lib.out_of_memory(e):
                raise
            # XLA's GPU autotuner runs a candidate's kernels on buffers of their full size
            # while compiling, so a shape far past the device fails to compile at all.
            log.info("update micro-batch %d x %d: its compile ran out of memory (%s): does "
                     "not fit", rows_per_shard, row_len, str(e).splitlines()[0][:160])
            return budget_lib.NO_FIT
        return max(acc_need, apply_need())

    def available():   # what the update may add to what is live now
        if memory is None:
            return None
        limit, in_use = budget_lib.device_memory(jax.local_devices()[0])
        return int(budget_lib.USABLE * limit) - in_use

    # What a start with the same model, mesh, settings and device found (`lrl.compile_cache`):
    # its smallest micro-batch's need and its budget, without compiling either again.
    # (One process: processes with caches of their own could choose different budgets.)
    # What else lives beside the update: the reference and PPO's critic (its update is
    # compiled for the same shapes, so a run with one must not take a budget found without).
    critic = p.state if p is not None and p.critic is not None else None
    key = (_budget_key(r, cfg, loss_cfg, sizes, (state, critic), memory,
                       held=(ref, rl_.estimator, rl_.kl_in_reward))
           if memory is not None and jax.process_count() == 1 else None)
    found = compile_cache.load_budget(r.cache.path, key) if key else None
    # The rollout's pool takes its share of what the smallest micro-batch leaves; the update's
    # budget is then what is left.
    engine = decode = None   # with the pipeline, on the rollout mesh (`build_pipeline`)
    least = 0
    if memory is not None:
        least = found["least"] if found else need(*budget_lib.smallest_shape(**sizes))
    if r.rollout_mesh is None:
        engine, decode = _engine(r, state.params, mesh, reserve=least)
    free = available()
    if found and found["need"] is not None and found["need"] > free:
        found = None   # less is free than when it was found: search again
    if found:
        budget = budget_lib.Budget(found["row_len"], found["rows_per_shard"], found["derived"],
                                   found["need"], free if found["need"] is not None else None)
    else:
        vocab = task.model_cfg.vocab_size
        budget = budget_lib.resolve(**sizes, need_bytes=need if memory is not None else None,
                                    available=free, floor_bytes=budget_lib.logits_floor(
                                        vocab, mesh.shape["seq"], mesh.shape["tensor"]))
        if key:
            compile_cache.save_budget(r.cache.path, key, dict(
                least=least, row_len=budget.row_len, rows_per_shard=budget.rows_per_shard,
                derived=budget.derived, need=budget.need_bytes))
    lengths = budget_lib.row_lengths(budget.row_len, sizes["unit"])
    tail = (f"; a minibatch's last rows in rows of {'/'.join(map(str, lengths[1:]))} tokens"
            if len(lengths) > 1 else "")
    r.writer.note(f"update micro-batch: {budget.describe()}{tail}, at most "
                  f"{cfg.max_segments - 1} sequences a row"
                  + (" (found by an earlier start, kept in the compile cache)" if found else ""))
    logp_fn = None
    if rl_.old_logp == "trainer" or ref:
        logp_fn = update_lib.make_logprobs_fn(cfg, mesh, **kw)
    prefill = None
    if _sequence_parallel_prefill(r, mesh):
        prefill = sp_prefill.make_prefill(mesh, opts.rollout.sp_min_tokens)
    return step_setup.Setup(
        rl=rl_, rollout=opts.rollout, seed=opts.seed, task=task, tokenizer=task.tokenizer,
        model_cfg=task.model_cfg, mesh=mesh, eos_ids=r.eos_ids, pool=pool, update=update,
        logprobs=logp_fn, shards=shards, row_len=budget.row_len,
        # A row of max_segments sequences would have one run more: its padding.
        rows_per_shard=budget.rows_per_shard, max_segments=cfg.max_segments - 1,
        buckets=lengths[1:],
        max_len=loss_cfg.max_len, prefill=prefill, engine=engine, decode=decode,
        # The frozen reference: the policy as this phase starts.
        ref_params=ref_params, ppo=p)


def _build_ppo(r: Run, cfg, state, critic_state, saved, loss_cfg, kw):
    """PPO's part of the step (`lrl.ppo`), or None when the step has no such pass; the critic
    restored, or made now from the policy (or critic.hf_path)."""
    opts = r.opts
    if not opts.rl.needs_ppo_pass:
        return None
    if opts.rl.uses_critic and critic_state is None:
        if saved:
            raise ckpt_lib.CheckpointError(
                "the checkpoint resumed holds PPO's step state but no critic item: it was "
                f"saved by a run without rl.estimator={opts.rl.estimator!r}")
        critic_state = ppo.init_critic(opts, cfg, r.mesh, state.params)
    p = ppo.build(opts, cfg, r.mesh, critic_state, saved, aggregation=loss_cfg.aggregation,
                  hidden=kw["hidden"], extra_keys=kw["extra_keys"])
    if p.critic is not None:
        r.writer.note(f"critic: the policy's decoder with a value head ("
                      f"{opts.critic.hf_path or 'from the policy'}), warm-up "
                      f"{opts.critic.warmup_steps} steps, {opts.critic.ppo_epochs} epoch(s)")
    return p


def _critic_spec(spec: dict) -> dict:
    """The critic update's micro-batch arrays, from the policy update's."""
    from lrl.rl import critic as critic_lib
    keys = critic_lib.ROW_KEYS + ("loss_mask", "prefix_ids")
    out = {k: v for k, v in spec.items() if k in keys}
    return {**out, "old_values": spec["loss_mask"], "returns": spec["loss_mask"]}


def _budget_key(r: Run, cfg, loss_cfg, sizes: dict, state, memory, held=()) -> str:
    """What the update's memory, and what is in use before it, depend on: the update's model
    config (remat, dtypes, runs a row), its loss, the row settings, the train states' arrays
    (the policy's, PPO's critic's) and what else is held (`held`: the reference, the estimator),
    the rollout pool's settings, the mesh, the device and its memory, jax."""
    o, device = r.opts, jax.local_devices()[0]
    return compile_cache.budget_key(
        model=cfg, model_options=o.model, loss=loss_cfg, sizes=sizes,
        update=(o.rl.logprob_chunk, o.rl.fused_head, o.rl.old_logp, o.rl.shared_prompt,
                o.rl.group_size, o.rl.max_new_tokens, o.data.max_prompt_len),
        rollout=o.rollout, pipeline=o.pipeline, extra=(r.task.extra_keys, _name(r.task.hidden)),
        state=[(x.shape, x.dtype, str(x.sharding)) for x in jax.tree.leaves(state)],
        held=held, mesh=dict(r.mesh.shape),
        device=(device.platform, device.device_kind, memory[0], jax.process_count(),
                jax.device_count()),
        jax=(jax.__version__, getattr(jax.lib, "__version__", "")))


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def build_pipeline(r: Run, s: step_setup.Setup, state) -> pipeline_lib.Pipeline:
    """The one-step-off pipeline's rollout half: the weights' handover to the rollout mesh,
    the engine there (its pool from the rollout devices' memory), and the step's setup with
    them (no sequence-parallel prefill: the rollout mesh has no `seq` axis)."""
    hand = pipeline_lib.handover(state.params, r.mesh, r.rollout_mesh)
    engine, decode = _engine(r, hand(state.params), r.rollout_mesh)
    r.writer.note(f"one-step-off pipeline: train on {mesh_lib.describe(r.mesh)}, sample on "
                  f"{mesh_lib.describe(r.rollout_mesh)}")
    roll = dataclasses.replace(s, mesh=r.rollout_mesh, engine=engine, decode=decode,
                               prefill=None)
    return pipeline_lib.Pipeline(s, roll, hand)


def _sequence_parallel_prefill(r: Run, mesh) -> bool:
    """Whether the rollout on `mesh` prefills long prompts sequence-parallel (ring or Ulysses
    over seq > 1, `lrl.rollout.sp_prefill`) rather than by the engine's own prefill."""
    return (r.opts.model.attention != "dense" and mesh.shape["seq"] > 1
            and r.rollout_mesh is None)


def _engine(r: Run, params, mesh, reserve: int = 0):
    """The rollout engine for the whole run on `mesh` (`params` on it), sized from the
    options: slots, the longest prompt and completion, a pool of `rollout.pool_tokens` or
    `rollout.pool_fraction` of the memory free now beyond `reserve` bytes (never more than
    every slot's longest sample needs), with its pool allocated now; and the decode-layout
    weights, relaid in place each step."""
    opts, cfg = r.opts, r.task.model_cfg
    ro, rl_ = opts.rollout, opts.rl
    prompt, new = options_lib.longest_prompt(opts), rl_.max_new_tokens
    ps = ro.page_size
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    decode = weights_lib.DecodeWeights(cfg, mesh)
    decode.refresh(params)   # allocated before the pool is sized
    # Every slot's longest sample, and a prefix of the longest prompt beside each.
    full = ro.max_slots * (pages_for(prompt + new - 1, ps) + pages_for(prompt, ps)) + 1
    if ro.pool_tokens:
        num_pages = pages_lib.num_pages_for_tokens(ro.pool_tokens, ps)
    elif budget_lib.device_memory(device) is not None:
        tensor = mesh.shape["tensor"]
        shards = tensor if cfg.n_kv_heads % tensor == 0 else 1
        limit, in_use = budget_lib.device_memory(device)
        free = int(budget_lib.USABLE * limit) - in_use - reserve
        page_bytes = pages_lib.kv_bytes_per_token(cfg) * ps // shards
        num_pages = min(full, int(free * ro.pool_fraction) // page_bytes)
        if num_pages < pages_for(prompt + new - 1, ps) + pages_for(prompt, ps) + 1:
            raise errors.UserError(
                f"rollout.pool_fraction={ro.pool_fraction} of the {free / 2**30:.1f} GiB the "
                f"update leaves holds {num_pages} pages of {ps} tokens, less than one sample of "
                f"{prompt} + {new} tokens", "config key rollout.pool_fraction",
                "raise it, set rollout.pool_tokens, or lower rl.max_tokens_per_micro")
    else:
        num_pages = full
    ecfg = rollout_lib.engine_config(
        cfg, max_prompt_len=prompt, max_new_tokens=new, max_slots=ro.max_slots,
        num_pages=num_pages, page_size=ps, prefill_tokens=ro.prefill_tokens,
        resumed_prompts=ro.partial, eos_ids=r.eos_ids,
        sampling=rollout_lib.SamplingParams(rl_.temperature, rl_.top_k, rl_.top_p),
        narrow_widths=None if ro.narrow_decode else (),
        # Long prompts in one whole-prompt call, unless sp_prefill takes them.
        whole_prefill=not _sequence_parallel_prefill(r, mesh))
    engine = rollout_lib.Engine(cfg, ecfg, mesh)
    state = engine.compile_prefill(decode.params, engine.take_state(),
                                   multimodal=r.task.multimodal)
    engine.keep_state(engine.compile_decode(decode.params, state,
                                            num_steps=rollout_lib.STEPS_PER_CALL))
    tail = (f", tail decode calls of {'/'.join(map(str, ecfg.narrow_widths))} rows"
            if ecfg.narrow_widths else "")
    narrow = "".join(f" (or {r} x {c})" for r, c in (
        (ecfg.prefill_narrow_rows, ecfg.prefill_chunk), (1, ecfg.prefill_short_chunk)) if r * c)
    whole = (f", longer prompts whole in calls of 1 x {'/'.join(map(str, ecfg.prefill_lengths))}"
             if ecfg.prefill_lengths else "")
    r.writer.note(f"rollout engine: {ro.max_slots} slots, a pool of {num_pages * ps} tokens "
                  f"({num_pages} pages of {ps}), prefill calls of {ecfg.rows_per_prefill} x "
                  f"{ecfg.prefill_chunk} tokens{narrow}{whole}{tail}")
    return engine, decode


def _bytes(tree) -> int:
    """Bytes of a tree's arrays on one device."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def grpo_phase(r: Run, state, tx, offset: int, steps: int, data_state: dict,
               where: str = "", saved: Optional[dict] = None) -> dict:
    """GRPO steps (not optimizer updates: epochs x minibatches of those per step).
    `where`: the checkpoint step directory `data_state` was read from (for its errors);
    `saved`: the further states it kept (PPO's `critic`, the KL's `reference`)."""
    saved = saved or {}
    opts = r.opts
    it = r.task.prompts("train")
    if data_state.get("prompt_iter"):
        it.set_state(data_state["prompt_iter"])
    pool = ex.reward_pool(opts, r.mesh)
    e = opts.eval
    held_out = r.task.eval_batches() if e.every else []
    step, metrics = int(data_state.get("step", 0)), {}
    carry, dropped = _restore_carry(r, data_state, where)
    r.writer.begin_phase("grpo", step, opts)
    p = None
    try:
        if data_state.get("step") and _keeps_reference(opts) and "reference" not in saved:
            log.warning("resume: the checkpoint keeps no KL reference (older lrl): the "
                        "reference is the restored policy, not the phase's first")
        s = build_grpo(r, state, tx, pool, saved.get("critic"), data_state.get("ppo"),
                       saved.get("reference"))
        # Who samples (the eval too): this mesh, or the pipeline's rollout mesh.
        roll, sampled = s, lambda params: params
        if r.rollout_mesh is not None:
            p = build_pipeline(r, s, state)
            roll, sampled = p.rollout, p.handover
        if held_out and step == 0:  # the baseline: the policy as GRPO starts
            r.writer.write(offset, grpo.evaluate(roll, sampled(state.params), held_out, e.k,
                                                 e.temperature, 0))
        while step < steps:
            try:
                if p is not None:
                    state, m, groups, carry = pipeline_lib.step(p, state, it, step, carry,
                                                                ahead=step + 1 < steps)
                else:
                    state, m, groups, carry = grpo.step(s, state, it, step, carry)
            except jax.errors.JaxRuntimeError as e:
                if not budget_lib.out_of_memory(e):
                    raise
                raise MemoryError(out_of_memory_message(opts, s, offset + step + 1, e)) from e
            step += 1
            if dropped:
                m["partial/dropped_on_resume"], dropped = dropped, 0
            if r.cache.path:   # programs this start loaded rather than compiled, so far
                m["compile_cache/loaded"] = r.cache.hits
            m.update(it.stats())
            if held_out and (step % e.every == 0 or step == steps):
                m.update(grpo.evaluate(roll, sampled(state.params), held_out, e.k,
                                       e.temperature, step))
            metrics = r.writer.write(offset + step, m)
            distributed.beat(f"grpo step {offset + step}")
            r.writer.samples(offset + step, _samples(groups, opts.metrics.samples_per_step))
            stopped = r.guard.should_stop(offset + step)
            _checkpoint(r, offset + step, state, lambda: {
                "phase": "grpo", "step": step, "prompt_iter": it.get_state(),
                **(pipeline_lib.to_state(carry) if p is not None else _carried(carry)),
                **({"ppo": s.ppo.to_state()} if s.ppo is not None else {})},
                        force=stopped or step == steps,
                        trees=_trees(s))
            if stopped:
                log.info("stopping at step %d on request (SIGTERM); checkpoint saved",
                         offset + step)
                break
    finally:
        held = partial_lib.kept_of(carry or ()) if p is None else ()
        if held:   # the run's KV goes with it: a resume prefills its carried samples again
            held[0].engine.release_kept(held)
        pool.close()
    r.writer.plot("grpo")
    return metrics


def out_of_memory_message(opts, s: step_setup.Setup, step: int, e) -> str:
    """What a step that ran out of device memory says: XLA's numbers and the settings that
    take memory, each with its value now."""
    ro, rl_ = opts.rollout, opts.rl
    first = next((x for x in str(e).splitlines() if "RESOURCE_EXHAUSTED" in x or
                  "memory" in x.lower()), str(e).splitlines()[0] if str(e) else "")
    return (f"GRPO step {step} ran out of device memory ({first.strip()[:300]}). The update's "
            f"micro-batches hold {s.rows_per_shard} x {s.row_len} tokens a data shard "
            f"(rl.max_tokens_per_micro={rl_.max_tokens_per_micro}, rl.row_len={rl_.row_len}; "
            "0 = from device memory); lower it, or rollout.pool_fraction="
            f"{ro.pool_fraction} / rollout.pool_tokens={ro.pool_tokens} (the rollout's KV "
            f"pool), rollout.max_slots={ro.max_slots}, or keep less with model.remat="
            f"{opts.model.remat!r} ('full' keeps least); more devices (mesh.fsdp, mesh.seq) "
            "split it")


def _keeps_reference(opts) -> bool:
    """The step keeps a frozen reference (a KL in the loss or in the reward)."""
    return bool(opts.rl.loss.kl_coef or opts.rl.kl_in_reward)


def _trees(s: step_setup.Setup) -> dict:
    """The states a GRPO checkpoint keeps beside the policy's: the frozen reference (the policy
    as the phase began: a resume must not take the restored policy for it) and PPO's critic."""
    out = {}
    if s.ref_params is not None:
        out["reference"] = s.ref_params
    if s.ppo is not None and s.ppo.critic is not None:
        out["critic"] = s.ppo.state
    return out


def _carried(carry) -> dict:
    """The carried groups, saved with the checkpoint so a resume continues the same samples
    (their prompts were drawn already: the data stream's position is past them), and their
    counts (all a checkpoint from before they were saved has)."""
    if not carry:
        return {}
    return {"carried_samples": sum(not x.done for g in carry for x in g.samples),
            "carried_groups": len(carry),
            "carried": partial_lib.to_state(carry, tasks.prompt_to_state)}


def _restore_carry(r: Run, data_state: dict, where: str):
    """-> (the carried groups a checkpoint saved, or None; how many carried samples it had
    but did not save: an older checkpoint's, dropped, logged, reported once). With the
    pipeline: the batch it sampled ahead (`lrl.pipeline`), or None."""
    if r.rollout_mesh is not None or "pipeline_batch" in data_state:
        batch, dropped = pipeline_lib.restore(data_state, r.rollout_mesh is not None, where)
        if dropped:
            log.warning("resume: dropping %s", dropped)
            r.writer.note(f"resume: {dropped} of the checkpoint dropped (this run's "
                          "pipeline.rollout_devices / rollout.partial cannot take it)")
        return batch, 0
    if "carried" in data_state:
        try:
            carry = partial_lib.from_state(data_state["carried"], tasks.prompt_from_state)
        except ValueError as e:
            # The data item read as JSON (an unreadable one is quarantined and an older step
            # restored, in `lrl.checkpoint`), yet its groups are not what this lrl saves. The
            # step's arrays checked out, so falling back (redoing steps) is the person's call.
            raise ckpt_lib.CheckpointError(
                f"the carried partial-rollout groups in {os.path.join(where, 'data')} are "
                f"malformed ({e}); move that step aside to resume from an older one") from e
        return carry, 0
    dropped = int(data_state.get("carried_samples", 0))
    if dropped:
        log.warning("resume: dropping %d carried partial-rollout samples", dropped)
        r.writer.note(f"resume: {dropped} carried partial-rollout samples (of "
                      f"{data_state.get('carried_groups', 0)} groups) were not saved by this "
                      "checkpoint (older lrl); dropped")
    return None, dropped


def _samples(groups: Groups, n: int) -> list[dict]:
    G = groups.group_size
    return [{"prompt": groups.prompts[i // G].text, "completion": groups.texts[i],
             "reward": float(groups.rewards_PG.flat[i]),
             "answer": str(groups.prompts[i // G].answer)}
            for i in range(min(n, len(groups.texts)))]
