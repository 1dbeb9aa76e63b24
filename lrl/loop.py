"""The one experiment loop, for every job and task: an optional SFT warm start (text), then
GRPO steps (text or video), with held-out evaluation, checkpoints (resumable, SIGTERM-safe)
and metrics. `run(config, workdir)` is what `python -m lrl.main` calls.

The config is read once, into typed options (`lrl.options`); what differs between text and
video is the task (`lrl.tasks`); one GRPO step's host half is `lrl.grpo.step`, or with
`pipeline.rollout_devices` `lrl.pipeline.step` (the rollout a step ahead on its own mesh).
Everything the phases run is built by `lrl.build` (the GRPO phase's `Setup` by `build.grpo`,
once per phase); the loop only loops. `run` takes the phase's build and step functions as
arguments, so a benchmark or a test wraps them (a forced sample length, a profiled step)
rather than reassigning module attributes:

    def with_lengths(*args):
        s, live = build.grpo(*args)
        return dataclasses.replace(s, max_new_fn=lengths), live

    loop.run(config, workdir, build=with_lengths, step=profiled(grpo.step))
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import jax

from lrl import build as build_lib
from lrl import checkpoint as ckpt_lib
from lrl import checkpoint_space as ckpt_space
from lrl import compile_cache
from lrl import compiles
from lrl import console
from lrl import distributed
from lrl import errors
from lrl import grpo, step_setup, tasks, trajectories, wandb_sink
from lrl import mesh as mesh_lib
from lrl import pipeline as pipeline_lib
from lrl import ppo as ppo_lib
from lrl import preflight
from lrl.build import Run
from lrl.groups import Groups
from lrl.metrics import MetricsWriter
from lrl.options import as_dict
from lrl.rl import budget as budget_lib
from lrl.rl import train as train_lib
from lrl.rl.sft import make_sft_fn
from lrl.rollout import partial as partial_lib

log = logging.getLogger(__name__)


# What builds a GRPO phase's setup (`lrl.build.grpo`'s arguments and result), and what runs
# one of its steps (`lrl.grpo.step`'s).
Build = Callable[..., tuple[step_setup.Setup, step_setup.Live]]
Step = Callable[..., tuple]


def run(config, workdir: str, started=None, *, build: Build = build_lib.grpo,
        step: Step = grpo.step) -> dict:
    """Runs the configured job; returns the last metrics of each phase. `started`: what
    `preflight.start(config, workdir)` returned, when the caller ran it already. `build`: what
    builds the GRPO phase's setup (`lrl.build.grpo`, or a wrapper of it); `step`: what runs
    one GRPO step (`lrl.grpo.step`, or a wrapper; the pipeline's steps are its own)."""
    # Every file the run reads checked, before anything is written to the workdir.
    opts, mesh, rollout_mesh = started or preflight.start(config, workdir)
    os.makedirs(workdir, exist_ok=True)
    with compile_cache.enabled(compile_cache.folder(opts.compile_cache, workdir)) as cache:
        return _run(opts, config, workdir, cache, mesh, rollout_mesh, build, step)


def _run(opts, config, workdir: str, cache: compile_cache.Cache, mesh, rollout_mesh,
         build: Build, step: Step) -> dict:
    task = tasks.build(opts, workdir, mesh)
    console.banner(opts, workdir, mesh, task.model_cfg)
    c = opts.checkpoint
    with ckpt_lib.PreemptionGuard() as guard, ckpt_lib.CheckpointManager(
            os.path.join(workdir, "checkpoints"), keep=c.keep, every_steps=c.every_steps,
            every_minutes=c.every_minutes, contents=c.contents) as ckpt:
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
            out = _run_phases(r, build, step)
        finally:
            writer.close()
    writer.summary()  # after the checkpoint manager has committed the last save
    return out


def _run_phases(r: Run, build: Build, step: Step) -> dict:
    opts = r.opts
    sft_steps, rl_steps = opts.sft.steps, opts.rl_steps
    # Masters and Adam moments in host memory when the device cannot hold them (lrl.rl.offload).
    off, why = build_lib.offload(opts.optim, r.task.model_cfg, r.mesh)
    if off:   # said when it changes what the device holds; "off" is the plain run's default
        r.writer.note(f"optimizer: masters and moments in host memory ({why})")
    sft_tx, rl_tx = build_lib.optimizers(opts, off, split_rest=r.mesh.size == 1)
    abstract, trees = build_lib.restore_targets(r, rl_tx)
    restored = r.ckpt.restore(abstract, trees=trees)
    if restored is not None:
        log.info("resumed from %s (step %d, phase %s)", restored.path, restored.step,
                 restored.data_state.get("phase"))
        r.task.restore(restored.data_state.get("task", {}))
        if restored.weights_only:
            _fresh_optimizers(r, restored, sft_tx, rl_tx)
    light = ckpt_space.tree_bytes(ckpt_lib.weights_only(abstract),
                                  {n: ckpt_lib.weights_only(t) for n, t in trees.items()})
    full = r.ckpt.space_warning(
        light if r.ckpt.contents == "weights" else ckpt_space.tree_bytes(abstract, trees), light)
    if full:
        log.warning(full)
    # Rows logged after the restored checkpoint by a run that died are logged again: cut them.
    r.writer.resume(restored.step if restored else 0,
                    restored.data_state["phase"] if restored else None)
    phase = restored.data_state["phase"] if restored else ("sft" if sft_steps else "grpo")
    state = restored.state if restored else None
    data_state = restored.data_state if restored else {}
    out = {}
    if phase == "sft" and sft_steps:
        if state is None:
            state = build_lib.train_state(r, r.task.initial_params(), sft_tx)
        state, out["sft"], stopped = sft_phase(r, state, sft_tx, sft_steps, data_state)
        if stopped or not rl_steps:
            return out
        data_state = {}
        state = build_lib.train_state(r, train_lib.masters(state), rl_tx)
    elif state is None:
        state = build_lib.train_state(r, r.task.initial_params(), rl_tx)
    if rl_steps:
        saved = restored.trees if restored and phase == "grpo" else {}
        out["grpo"] = grpo_phase(r, state, rl_tx, sft_steps, rl_steps, data_state,
                                 restored.path if restored else "", saved, build=build,
                                 step_fn=step)
    return out


def _fresh_optimizers(r: Run, restored, sft_tx, rl_tx) -> None:
    """A step saved with `checkpoint.contents="weights"` has no optimizer state: each train
    state starts its optimizer again on the restored weights, its update count kept."""
    st = restored.state
    tx = sft_tx if restored.data_state.get("phase") == "sft" else rl_tx
    restored.state = build_lib.train_state(r, st.params, tx)._replace(step=st.step)
    if "critic" in restored.trees:
        c = restored.trees["critic"]
        restored.trees["critic"] = ppo_lib.critic_on(r.opts, r.task.model_cfg, r.mesh,
                                                      c.params)._replace(step=c.step)
    log.warning("resume: step %d (%s) holds the weights only (checkpoint.contents='weights'): "
                "the optimizer starts again, its moments at zero and its learning-rate "
                "schedule from its warm-up", restored.step, restored.path)


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

def grpo_phase(r: Run, state, tx, offset: int, steps: int, data_state: dict,
               where: str = "", saved: Optional[dict] = None, *,
               build: Build = build_lib.grpo, step_fn: Step = grpo.step) -> dict:
    """GRPO steps (not optimizer updates: epochs x minibatches of those per step).
    `where`: the checkpoint step directory `data_state` was read from (for its errors);
    `saved`: the further states it kept (PPO's `critic`, the KL's `reference`); `build`,
    `step_fn`: as `run`'s."""
    saved = saved or {}
    opts = r.opts
    it = r.task.prompts("train")
    if data_state.get("prompt_iter"):
        it.set_state(data_state["prompt_iter"])
    pool = build_lib.reward_pool(opts, r.mesh)
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
        # The setup (built once) and what the steps change (PPO's state, the shapes run).
        s, live = build(r, state, tx, pool, saved.get("critic"), data_state.get("ppo"),
                        saved.get("reference"))
        # Who samples (the eval too): this mesh, or the pipeline's rollout mesh.
        roll, sampled = s, lambda params: params
        if r.rollout_mesh is not None:
            p = build_lib.pipeline(r, s, state)
            roll, sampled = p.rollout, p.handover
        if held_out and step == 0:  # the baseline: the policy as GRPO starts
            r.writer.write(offset, grpo.evaluate(roll, sampled(state.params), held_out, e.k,
                                                 e.temperature, 0))
        first = True
        while step < steps:
            spent, counted = compiles.seconds(), compiles.snapshot()
            try:
                if p is not None:
                    state, m, groups, carry = pipeline_lib.step(
                        p, live, state, it, step, carry, ahead=step + 1 < steps)
                else:
                    state, m, groups, carry = step_fn(s, live, state, it, step, carry)
            except jax.errors.JaxRuntimeError as e:
                if not budget_lib.out_of_memory(e):
                    raise
                raise MemoryError(out_of_memory_message(opts, s, offset + step + 1, e)) from e
            step += 1
            spent = compiles.seconds_since(spent)
            m["compiles/seconds"] = sum(spent.values())
            if first and spent:   # where a start's time goes: the costliest programs
                m.update(compiles.top(spent))
                log.debug("step %d compiled or loaded %d programs in %.0f s: %s", offset + step,
                          sum(compiles.since(counted).values()), m["compiles/seconds"],
                          compiles.describe(spent, compiles.since(counted)))
            first = False
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
            r.writer.samples(offset + step, _samples(groups, opts.metrics.samples_per_step,
                                                     s.tokenizer))
            stopped = r.guard.should_stop(offset + step)
            _checkpoint(r, offset + step, state, lambda: {
                "phase": "grpo", "step": step, "prompt_iter": it.get_state(),
                **(pipeline_lib.to_state(carry) if p is not None else _carried(carry)),
                **({"ppo": live.ppo.to_state()} if live.ppo is not None else {})},
                        force=stopped or step == steps,
                        trees=_trees(s, live))
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
    if budget_lib.out_of_host_memory(e):
        return (f"GRPO step {step} ran out of host memory ({first.strip()[:300]}): "
                f"{errors.host_memory_culprit()}. To do: " + errors.host_memory_todo(
                    f" (now {opts.optim.offload!r})", f" (now {opts.model.param_dtype!r})"))
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


def _trees(s: step_setup.Setup, live: step_setup.Live) -> dict:
    """The states a GRPO checkpoint keeps beside the policy's: the frozen reference (the policy
    as the phase began: a resume must not take the restored policy for it) and PPO's critic."""
    out = {}
    if s.ref_params is not None:
        out["reference"] = s.ref_params
    if live.ppo is not None and live.ppo.critic is not None:
        out["critic"] = live.ppo.state
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


def _samples(groups: Groups, n: int, tokenizer=None) -> list[dict]:
    G = groups.group_size
    out = [{"prompt": groups.prompts[i // G].text, "completion": groups.texts[i],
            "reward": float(groups.rewards_PG.flat[i]),
            "answer": str(groups.prompts[i // G].answer)}
           for i in range(min(n, len(groups.texts)))]
    if groups.masks and tokenizer is not None:   # multi-turn: the tool's answers too
        for i, rec in enumerate(out):
            rec["trajectory"] = trajectories.trajectory_text(
                tokenizer, groups.completions[i], groups.masks[i])
    return out
