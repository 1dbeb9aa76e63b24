"""The one-step-off-policy pipeline (verl's `one_step_off_policy` trainer, the JAX way), on
with `pipeline.rollout_devices`: two meshes on disjoint devices (`lrl.mesh.
build_meshes`), the train state on the training mesh as always, the rollout engine and its
decode weights on the rollout mesh. Step t:

    hand over w_t (the params after update t-1): gathered on the training devices into the
        slices the rollout mesh holds (`Handover`), copied device to device, then relaid
        for decoding by the engine's `DecodeWeights`;
    start the rollout of step t+1 under w_t in a thread (the engine's host loop blocks on
        the host; JAX dispatch is thread-safe);
    update on step t's batch, sampled a step earlier under w_{t-1}, on the training mesh;
    join.

Every step so trains on samples one policy version old: their ages are 1 (`Groups.ages`, which
the staleness weight reads and `pipeline/age_*` report), and old log-probs taken from the
sampler are the behaviour policy's, as the rollout correction (`rl.loss.tis_cap`,
`mask_level`) expects. A run's first step (and a resume from a checkpoint that saved no batch)
has nothing sampled ahead: it samples its own batch first, under its own weights (age 0), then
goes on as above. The prompts are drawn in order, by the rollout alone, and scored as in a
synchronous step.

The batch in hand after a step is finished and scored, so a checkpoint saves it with the state
(`to_state`, in the data state), and a resume trains on exactly the batch the uninterrupted run
would have (bit-exact: tokens and log-probs as saved).

Metrics of step t: `pipeline/update_s` (its update), `pipeline/rollout_s` (the rollout of step
t+1 beside it, 0 on the last step), `pipeline/wall_s` (the two overlapped), `pipeline/saved_s`
(their sum minus the wall time) and `pipeline/overlap` (that over the shorter of the two: 1 when
it was hidden entirely), `pipeline/handover_s` (gather, copy; the decode relayout is part of
the rollout) and `pipeline/age_mean` / `age_max`; `time/rollout_s` stays the rollout of the
batch the step trained.

P prompts · G samples per prompt.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from typing import Callable, Optional

import jax
import numpy as np

from lrl import checkpoint as ckpt_lib
from lrl import collect, compiles, grpo, step_setup, tasks
from lrl.groups import Groups
from lrl import mesh as mesh_lib
from lrl.models import params as params_lib
from lrl.rollout import weights as weights_lib


@dataclasses.dataclass(frozen=True)
class Handover:
    """Training-layout params on the training mesh -> the same tree on the rollout mesh, with
    the decode sharding rules (`tensor` only; the prefill reads this tree, the decode steps
    its relayout). `gather` (jitted once) lays the params out on the training devices in the
    very slices the rollout devices hold, so the copy is one device-to-device transfer per
    slice and never passes through the host; the gathered tree lives on the training devices
    only for the copy (1 / rollout `tensor` of the params a device, in their dtype). The last
    copy is kept: handing the same params over again (the eval after a step, then the next
    step) copies nothing."""
    gather: Callable
    target: object                 # NamedShardings on the rollout mesh
    last: dict = dataclasses.field(default_factory=dict)

    def __call__(self, params):
        if self.last.get("source") is params:
            return self.last["copy"]
        self.last.clear()          # the previous copy goes before the next lands
        out = jax.device_put(self.gather(params), self.target)
        # Done before the update donates the source's buffers.
        jax.block_until_ready(out)
        self.last.update(source=params, copy=out)
        return out


def handover(params, mesh, rollout_mesh) -> Handover:
    """The `Handover` of a params tree (arrays or ShapeDtypeStructs) from `mesh` to
    `rollout_mesh`: the training devices, reshaped to the rollout mesh's `tensor` size (which
    must divide their count), gather the params into the rollout's tensor slices."""
    stage_mesh = mesh_lib.reshape(mesh, {"fsdp": -1, "tensor": rollout_mesh.shape["tensor"]})
    axes = params_lib.logical_axes(params)
    rules = weights_lib.DECODE_RULES
    stage = mesh_lib.param_shardings(stage_mesh, params, axes, rules)
    target = mesh_lib.param_shardings(rollout_mesh, params, axes, rules)
    return Handover(jax.jit(lambda p: p, out_shardings=stage), target)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's batch, sampled and scored ahead of its update."""
    groups: Groups
    metrics: dict                  # the rollout's and the rewards' (numbers)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What a pipelined step uses, built once where the loop is built."""
    train: step_setup.Setup           # the update's programs, on the training mesh
    rollout: step_setup.Setup         # the same, with the rollout mesh and its engine
    handover: Handover


def sample(p: Pipeline, params, it, step_index: int, age: int) -> Batch:
    """Step `step_index`'s batch, drawn by the rollout mesh under `params` (on it), which are
    `age` policy versions older than those that will train on it."""
    groups, m = collect.collect(p.rollout, params, it, step_index)
    ages = np.full(len(groups.completions), age, np.int32)
    return Batch(dataclasses.replace(groups, ages=ages), m)


def _timed(fn, *args):
    t0 = time.time()
    return fn(*args), time.time() - t0


def step(p: Pipeline, live: step_setup.Live, state, it, step_index: int,
         batch: Optional[Batch], ahead: bool):
    """One pipelined GRPO step -> (new state, metrics, the groups trained, the next step's
    batch: sampled beside the update when `ahead`, else None). `batch`: this step's, sampled
    a step earlier; None samples it first, under the state's own weights."""
    before = compiles.snapshot()
    t0 = time.time()
    params = p.handover(state.params)
    handover_s = time.time() - t0
    if batch is None:
        batch = sample(p, params, it, step_index, age=0)
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lrl-rollout") as pool:
        future = pool.submit(_timed, sample, p, params, it, step_index + 1, 1) if ahead else None
        state, m = grpo.learn(p.train, live, state, batch.groups, dict(batch.metrics), before)
        update_s = time.time() - t0
        nxt, rollout_s = future.result() if future is not None else (None, 0.0)
    wall_s = time.time() - t0
    saved = update_s + rollout_s - wall_s
    ages = batch.groups.sample_ages()
    m.update({"pipeline/update_s": update_s, "pipeline/rollout_s": rollout_s,
              "pipeline/wall_s": wall_s, "pipeline/saved_s": saved,
              "pipeline/overlap": saved / max(min(update_s, rollout_s), 1e-9) if ahead else 0.0,
              "pipeline/handover_s": handover_s,
              "pipeline/age_mean": float(ages.mean()), "pipeline/age_max": float(ages.max()),
              # counted again here: the rollout beside the update compiles too
              "compiles/step": sum(compiles.since(before).values()),
              "compiles/total": compiles.total()})
    return state, m, batch.groups, nxt


# ----------------------------------------------------------------------------- checkpoint

def to_state(batch: Optional[Batch]) -> dict:
    """The batch in hand as JSON data for the checkpoint's data state (tokens as ints,
    log-probs and rewards as their float32 bytes: bit-exact); {} without one."""
    if batch is None:
        return {}
    g = batch.groups
    return {"pipeline_batch": {
        "prompts": [tasks.prompt_to_state(x) for x in g.prompts],
        "completions": [np.asarray(c).tolist() for c in g.completions],
        "logps": [np.asarray(x, "<f4").tobytes() for x in g.logps],
        "group_size": g.group_size, "truncated": np.asarray(g.truncated).tolist(),
        "texts": list(g.texts), "rewards": np.asarray(g.rewards_PG, "<f4").tobytes(),
        "ages": g.sample_ages().tolist(),
        # ReMax's greedy rewards (collect.with_baseline), when the estimator asked for them
        "baseline": (None if g.baseline_P is None
                     else np.asarray(g.baseline_P, "<f4").tobytes()),
        "metrics": {k: float(v) for k, v in batch.metrics.items()
                    if isinstance(v, (int, float, np.number))}}}


def from_state(d: dict) -> Batch:
    """The inverse of `to_state`'s entry; a malformed one raises ValueError."""
    try:
        prompts = tuple(tasks.prompt_from_state(x) for x in d["prompts"])
        G = int(d["group_size"])
        completions = tuple(np.asarray(c, np.int32) for c in d["completions"])
        logps = tuple(np.frombuffer(x, "<f4").astype(np.float32) for x in d["logps"])
        rewards = np.frombuffer(d["rewards"], "<f4").astype(np.float32)
        n = len(prompts) * G
        if not (len(completions) == len(logps) == len(d["truncated"]) == len(d["ages"]) == n
                and rewards.size == n
                and all(c.shape == x.shape for c, x in zip(completions, logps))):
            raise ValueError(f"{len(prompts)} prompts x {G} samples do not match the saved "
                             "completions, log-probs, rewards and ages")
        groups = Groups(prompts, completions, logps, G,
                                np.asarray(d["truncated"], bool), tuple(d["texts"]),
                                rewards.reshape(len(prompts), G),
                                np.asarray(d["ages"], np.int32),
                                # absent from checkpoints written before ReMax
                                _baseline(d.get("baseline"), len(prompts)))
        return Batch(groups, dict(d["metrics"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from e


def _baseline(saved, P: int) -> Optional[np.ndarray]:
    if saved is None:
        return None
    b = np.frombuffer(saved, "<f4").astype(np.float32)
    if b.size != P:
        raise ValueError(f"{P} prompts do not match the saved {b.size} baseline rewards")
    return b


def restore(data_state: dict, pipelined: bool, where: str) -> tuple[Optional[Batch], str]:
    """-> (the batch a checkpoint sampled ahead, when this run pipelines and it saved one;
    what of the checkpoint's in-flight work this run cannot take and drops: a pipelined
    checkpoint's batch in a run without the pipeline, a partial run's carried samples in a
    pipelined one; "" for nothing). `where`: the checkpoint's step directory."""
    saved = data_state.get("pipeline_batch")
    if pipelined and saved is not None:
        try:
            return from_state(saved), ""
        except ValueError as e:
            raise ckpt_lib.CheckpointError(
                f"the pipeline's batch in {os.path.join(where, 'data')} is malformed ({e}); "
                "move that step aside to resume from an older one") from e
    if saved is not None:
        return None, "the batch the pipeline sampled ahead"
    carried = data_state.get("carried_samples", 0)
    return None, f"{carried} carried partial-rollout samples" if carried else ""
