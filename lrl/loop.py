"""The experiment loop: an optional SFT warm start, then GRPO steps, with evaluation,
checkpoints (resumable, SIGTERM-safe) and metrics. `run(config, workdir)` is what
`python -m lrl.main` calls.

One GRPO step, as DESIGN.md draws it: prompts -> rollout (G samples each) -> rewards ->
(dynamic sampling) -> advantages -> packing -> (old / reference log-probs) -> epochs x
minibatches of `update_step` -> metrics. Jitted functions are built once, here.

P prompts · G samples per prompt · B packed rows · T positions.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import numpy as np

from lrl import checkpoint as ckpt_lib
from lrl import console
from lrl import distributed
from lrl import experiment as ex
from lrl import grpo
from lrl import mesh as mesh_lib
from lrl.metrics import MetricsWriter
from lrl.rl import update as update_lib
from lrl.rl.sft import make_sft_fn

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """What every phase needs; built once from the config."""
    config: object
    workdir: str
    mesh: object
    tokenizer: object
    model_cfg: object
    ckpt: ckpt_lib.CheckpointManager
    guard: ckpt_lib.PreemptionGuard
    writer: MetricsWriter

    @property
    def eos_ids(self):
        return self.model_cfg.eos_token_ids or (self.tokenizer.eos_token_id,)


def run(config, workdir: str) -> dict:
    """Runs the configured job; returns the last metrics of each phase."""
    if config.job == "grpo_video":  # vision-language GRPO (configs/video_synthetic.py)
        from lrl import vl_grpo
        return vl_grpo.run(config, workdir)
    ex.check_config(config)
    os.makedirs(workdir, exist_ok=True)
    mesh = ex.build_mesh(config)
    tokenizer = ex.build_tokenizer(config, workdir)
    model_cfg = ex.model_config(config, tokenizer)
    console.banner(config, workdir, mesh, model_cfg)
    sft_steps = config.sft.steps
    rl_steps = config.rl.steps if config.job == "grpo" else 0
    if config.job == "sft" and sft_steps < 1:
        raise ValueError("job='sft' needs sft.steps >= 1")
    c = config.checkpoint
    with ckpt_lib.PreemptionGuard() as guard, ckpt_lib.CheckpointManager(
            os.path.join(workdir, "checkpoints"), keep=c.keep, every_steps=c.every_steps,
            every_minutes=c.every_minutes) as ckpt:
        ckpt.save_tokenizer(tokenizer)
        writer = MetricsWriter(workdir, sft_steps + rl_steps,
                               tensorboard=config.metrics.tensorboard,
                               phases={"sft": sft_steps, "grpo": rl_steps})
        r = Run(config, workdir, mesh, tokenizer, model_cfg, ckpt, guard, writer)
        try:
            out = _run_phases(r, sft_steps, rl_steps)
        finally:
            writer.close()
    writer.summary()  # after the checkpoint manager has committed the last save
    return out


def _run_phases(r: Run, sft_steps: int, rl_steps: int) -> dict:
    config = r.config
    sft_tx = ex.optimizer(config.optim, sft_steps, lr=config.sft.lr,
                          warmup=config.sft.warmup_steps) if sft_steps else None
    rl_tx = ex.optimizer(config.optim, rl_steps) if rl_steps else sft_tx
    # Both phases use the same optimizer structure (only the schedules differ), so one
    # abstract state restores either phase's checkpoint.
    restored = _restore(r, rl_tx)
    phase = restored.data_state["phase"] if restored else ("sft" if sft_steps else "grpo")
    state = restored.state if restored else None
    data_state = restored.data_state if restored else {}
    out = {}
    if phase == "sft" and sft_steps:
        if state is None:
            params = ex.initial_params(config, r.model_cfg, r.mesh)
            state = update_lib.TrainState(np.zeros((), np.int32), params, sft_tx.init(params))
            state = jax.device_put(state, update_lib.train_state_shardings(
                r.model_cfg, sft_tx, r.mesh))
        state, out["sft"], stopped = sft_phase(r, state, sft_tx, sft_steps, data_state)
        if stopped or not rl_steps:
            return out
        data_state = {}
        state = _fresh_optimizer(r, state, rl_tx)
    elif state is None:
        params = ex.initial_params(config, r.model_cfg, r.mesh)
        state = _fresh_optimizer(r, update_lib.TrainState(np.zeros((), np.int32), params, None),
                                 rl_tx)
    if rl_steps:
        out["grpo"] = grpo_phase(r, state, rl_tx, sft_steps, rl_steps, data_state)
    return out


def _fresh_optimizer(r: Run, state, tx):
    """The GRPO phase starts its own optimizer (and step count) on the warm-started params."""
    fresh = update_lib.TrainState(np.zeros((), np.int32), state.params, tx.init(state.params))
    return jax.device_put(fresh, update_lib.train_state_shardings(r.model_cfg, tx, r.mesh))


def _restore(r: Run, tx):
    got = r.ckpt.restore(update_lib.abstract_train_state(r.model_cfg, tx, r.mesh))
    if got is not None:
        log.info("resumed from %s (step %d, phase %s)", got.path, got.step,
                 got.data_state.get("phase"))
    return got


def _put_batch(r: Run, arrays: dict):
    """Host arrays -> global device arrays with rows over (data, fsdp), positions over seq.
    Each process holds its own rows: with several processes the global batch is assembled
    from the local pieces."""
    sharding = mesh_lib.batch_sharding(r.mesh, 2)
    if jax.process_count() == 1:
        return {k: jax.device_put(np.asarray(v), sharding) for k, v in arrays.items()}
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in arrays.items()}


def _checkpoint(r: Run, step: int, state, data_state: dict, force: bool = False):
    if force or r.ckpt.should_save(step):
        r.ckpt.save(step, state, data_state=data_state, config=r.config.to_dict(),
                    model_config=r.model_cfg)


# ----------------------------------------------------------------------------- SFT

def sft_phase(r: Run, state, tx, steps: int, data_state: dict):
    it = ex.sft_iterator(r.config, r.tokenizer, r.mesh)
    if data_state.get("sft_iter"):
        it.set_state(data_state["sft_iter"])
    step_fn = make_sft_fn(r.model_cfg, tx, r.mesh)
    step = int(jax.device_get(state.step))
    r.writer.begin_phase("sft", step, r.config)
    metrics, stopped = {}, False
    while step < steps:
        batch = next(it)
        arrays = {k: batch[k] for k in ("tokens", "positions", "segment_ids", "targets",
                                        "loss_mask")}
        state, m = step_fn(state, _put_batch(r, arrays))
        step += 1
        metrics = r.writer.write(step, jax.device_get(m), phase="sft")
        distributed.beat(f"sft step {step}")
        stopped = r.guard.should_stop(step)
        _checkpoint(r, step, state, {"phase": "sft", "sft_iter": it.get_state()},
                    force=stopped or step == steps)
        if stopped:
            break
    r.writer.plot("sft")
    return state, metrics, stopped


# ----------------------------------------------------------------------------- GRPO

def grpo_phase(r: Run, state, tx, offset: int, steps: int, data_state: dict) -> dict:
    config, rl_cfg = r.config, r.config.rl
    it = ex.prompt_iterator(config, r.tokenizer, r.mesh)
    if data_state.get("prompt_iter"):
        it.set_state(data_state["prompt_iter"])
    pool = ex.reward_pool(config)
    loss_cfg = ex.loss_config(config)
    shards = ex.data_shards(r.mesh)
    # Sampler log-probs equal the trainer's only for plain temperature-1 sampling.
    plain = rl_cfg.temperature == 1.0 and rl_cfg.top_k == 0 and rl_cfg.top_p == 1.0
    use_sampler_logp = plain and not rl_cfg.recompute_old_logp
    needs_old = rl_cfg.epochs * rl_cfg.minibatches > 1 or use_sampler_logp
    update_fn = update_lib.make_update_fn(r.model_cfg, loss_cfg, tx, r.mesh,
                                          num_micro=rl_cfg.micro_batches,
                                          chunk=rl_cfg.logprob_chunk,
                                          fused_head=rl_cfg.fused_head)
    logp_fn = None
    if (needs_old and not use_sampler_logp) or loss_cfg.kl_coef:
        logp_fn = update_lib.make_logprobs_fn(r.model_cfg, r.mesh,
                                              num_micro=rl_cfg.micro_batches,
                                              chunk=rl_cfg.logprob_chunk)
    ref_params = None
    if loss_cfg.kl_coef:  # the frozen reference: the policy as this phase starts
        ref_params = jax.tree.map(lambda x: x.copy(), state.params)
    evaluator = Evaluator(r) if config.eval.every else None
    # GRPO steps, not optimizer updates (epochs x minibatches of them per step).
    step = int(data_state.get("step", 0))
    r.writer.begin_phase("grpo", step, config)
    metrics = {}
    try:
        if evaluator and step == 0:  # the baseline: the policy as GRPO starts
            r.writer.write(offset, evaluator(state.params, 0, pool))
        while step < steps:
            t0 = time.time()
            rollout_stats = {}
            groups, m = collect(r, state.params, it, pool, step, rollout_stats)
            t_rollout = time.time() - t0
            weight = grpo.overlong_shaping(groups, rl_cfg)
            adv_PG = grpo.advantages(groups, rl_cfg.estimator)
            # Every process sampled and scored the same global prompts; each packs its share.
            mine = _process_share(groups.P)
            mine_samples = np.repeat(mine, groups.group_size)
            local = groups.take(mine)
            rows_multiple = rl_cfg.minibatches * rl_cfg.micro_batches * shards
            pack = lambda min_rows: grpo.update_rows(  # noqa: E731
                local, adv_PG[mine], weight[mine_samples], row_len=rl_cfg.row_len,
                rows_multiple=rows_multiple, use_sampler_logp=use_sampler_logp,
                min_rows=min_rows)
            rows, layout = pack(0)
            # Every process must feed the same number of rows into the global batch.
            n_rows = distributed.max_over_processes(rows["tokens"].shape[0])
            if n_rows != rows["tokens"].shape[0]:
                rows, layout = pack(n_rows)
            # Minibatches are cut on the host, so each goes to the devices in its sharding.
            per = rows["tokens"].shape[0] // rl_cfg.minibatches
            batches = [_put_batch(r, {k: v[i * per:(i + 1) * per] for k, v in rows.items()})
                       for i in range(rl_cfg.minibatches)]
            for batch in batches:  # old / reference log-probs before any update of this step
                if needs_old and not use_sampler_logp:
                    batch["old_logp"] = logp_fn(state.params, batch)
                if ref_params is not None:
                    batch["ref_logp"] = logp_fn(ref_params, batch)
            t1 = time.time()
            state, um = _updates(update_fn, state, batches, rl_cfg.epochs)
            um = jax.device_get(um)
            step += 1
            m.update(um)
            m.update({"time/rollout_s": t_rollout, "time/update_s": time.time() - t1,
                      "advantage/abs_mean": float(np.abs(adv_PG).mean()),
                      "pack/rows": rows["tokens"].shape[0],
                      "pack/fill": float((rows["segment_ids"] > 0).mean()),
                      "pack/truncated": layout["num_truncated"],
                      **{f"rollout/{k}": v for k, v in rollout_stats.items()
                         if np.isscalar(v)},
                      **it.stats()})
            if evaluator and (step % config.eval.every == 0 or step == steps):
                m.update(evaluator(state.params, step, pool))
            metrics = r.writer.write(offset + step, m)
            distributed.beat(f"grpo step {offset + step}")
            r.writer.samples(offset + step, [
                {"prompt": r.tokenizer.decode(groups.prompt_ids[i // groups.group_size]),
                 "completion": groups.texts[i], "reward": float(groups.rewards_PG.flat[i]),
                 "answer": str(groups.answers[i // groups.group_size])}
                for i in range(min(config.metrics.samples_per_step, len(groups.texts)))])
            stopped = r.guard.should_stop(offset + step)
            _checkpoint(r, offset + step, state, {"phase": "grpo", "step": step,
                                                  "prompt_iter": it.get_state()},
                        force=stopped or step == steps)
            if stopped:
                log.info("stopping at step %d on request (SIGTERM); checkpoint saved",
                         offset + step)
                break
    finally:
        pool.close()
    r.writer.plot("grpo")
    return metrics


def collect(r: Run, params, it, pool, step: int, stats: dict):
    """Rollout + rewards for one step, with DAPO dynamic sampling when configured."""
    rl_cfg = r.config.rl
    parts, m, draws = [], {}, 0
    while True:
        batch = _global_batch(next(it))
        seed = r.config.seed * 1_000_003 + step * 101 + draws
        groups = grpo.sample(r.model_cfg, params, batch, group_size=rl_cfg.group_size,
                             rl_cfg=rl_cfg, rollout_cfg=r.config.rollout, eos_ids=r.eos_ids,
                             seed=seed, mesh=r.mesh, stats=stats)
        reward_stats = grpo.score(groups, pool, r.tokenizer)
        if not parts:
            m.update(grpo.rollout_metrics(groups, r.eos_ids))
            m.update(reward_stats)
        draws += 1
        if not rl_cfg.dynamic_sampling:
            return groups, m
        keep = grpo.informative(groups.rewards_PG)
        m["groups/informative_frac"] = m.get("groups/informative_frac", float(keep.mean()))
        if keep.any():
            parts.append(groups.take(keep))
        have = sum(p.P for p in parts)
        if have >= rl_cfg.prompts_per_step or draws > rl_cfg.max_resample:
            break
    if not parts:  # every group was uniform: learn nothing this step, but keep going
        log.warning("dynamic sampling: all %d groups had equal rewards after %d draws",
                    rl_cfg.prompts_per_step * draws, draws)
        parts = [groups]
    m["groups/draws"] = draws
    merged = grpo.Groups.concat(parts)
    keep_P = np.zeros(merged.P, bool)
    keep_P[:min(merged.P, rl_cfg.prompts_per_step)] = True
    m["groups/kept"] = int(keep_P.sum())
    return merged.take(keep_P), m


def _global_batch(batch: dict) -> dict:
    """Every process's prompt batch joined, in process order, on every process.

    A multi-controller run must launch the same programs on the same inputs everywhere: the
    rollout's prefill buckets, decode calls and dynamic-sampling decisions all depend on the
    prompts, so every process decodes the global batch (same seed, same samples) and later
    keeps its own share for the update."""
    if jax.process_count() == 1:
        return batch
    parts = distributed.allgather_objects(
        {k: batch[k] for k in ("prompt_ids", "answer", "task", "metadata")})
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}


def _process_share(P: int) -> np.ndarray:
    """[P] bool: the prompts whose samples this process packs and feeds."""
    n, i = jax.process_count(), jax.process_index()
    per = P // n
    mine = np.zeros(P, bool)
    mine[i * per:(i + 1) * per] = True
    return mine


def _updates(update_fn, state, batches, epochs: int):
    """epochs x minibatches of update_step; the metrics are the last update's."""
    metrics = None
    for _ in range(epochs):
        for batch in batches:
            state, metrics = update_fn(state, batch)
    return state, metrics


class Evaluator:
    """Held-out prompts every `eval.every` steps: mean reward, pass@1 and pass@k."""

    def __init__(self, r: Run):
        self.r = r
        self.batches = None
        it = ex.prompt_iterator(r.config, r.tokenizer, r.mesh, split="eval")
        if it is not None:
            local = []
            try:
                while True:
                    local.append(next(it))
            except StopIteration:
                pass
            # The same prompts on every process (see _global_batch), in one flat list.
            parts = distributed.allgather_objects(local)
            self.batches = [b for p in parts for b in p]

    def __call__(self, params, step: int, pool) -> dict:
        if not self.batches:
            return {}
        r, e = self.r, self.r.config.eval
        rewards = []
        for i, batch in enumerate(self.batches):
            groups = grpo.sample(r.model_cfg, params, batch, group_size=e.k,
                                 rl_cfg=r.config.rl, rollout_cfg=r.config.rollout,
                                 eos_ids=r.eos_ids, seed=10_007 * step + i, mesh=r.mesh,
                                 temperature=e.temperature)
            grpo.score(groups, pool, r.tokenizer)
            rewards.append(groups.rewards_PG)
        rewards_PG = np.concatenate(rewards)
        correct = rewards_PG >= 1.0
        return {"eval/reward/mean": float(rewards_PG.mean()),
                "eval/pass@1": grpo.pass_at_k(correct, 1),
                f"eval/pass@{e.k}": grpo.pass_at_k(correct, e.k)}
