"""The learning half of a GRPO step, and the step as one function: `step(setup, state, it, i)`
collects G samples per prompt and scores them (`lrl.collect`, with dynamic sampling), then
`learn` shapes them, turns rewards into advantages, keeps this process's share, cuts it into
minibatches of samples, packs each into rows and micro-batches of a few fixed shapes, takes
the old and reference log-probs, and runs the updates. The device half (the update and
log-prob programs, compiled once for each micro-batch shape, and the rollout engine) is built
once (`lrl.build.grpo`) and handed in as `Setup` (`lrl.step_setup`), with `Live`, what the
steps change: PPO's state and the micro-batch shapes run so far.

Each stage is a module-level function of plain values that returns new values (`Groups` is
frozen), so the order of calls is the data flow below and each stage can be read, tested and
swapped alone:

    collect.collect -> shape_overlong -> advantages -> process_share -> minibatches (pack,
            micro-batches, placed) -> warm_up -> old_and_ref_logps -> mismatch_metrics ->
            loss_inputs -> updates (whose first minibatch's forward also measures the
            sampler-trainer mismatch, unless the old log-probs' trainer forward did)

`step` is `collect.collect` then `learn` (everything from `shape_overlong` on), which the
one-step-off pipeline (`lrl.pipeline`) calls on a batch it sampled a step ahead.
With `rollout.partial`, `collect_partial.collect_partial` takes `collect`'s place: the
rollout stops on its budget and the groups still running are carried into the next step
(`lrl.rollout.partial`); the step takes them in and hands the new carry back, and `learn`
trains however many groups completed.

A micro-batch is [shards x rows_per_shard, row_len] or, for a minibatch's last rows,
[shards, T'] with T' row_len or one of `Setup.buckets` (`lrl.data.packing.Cut`), the same
shapes for the whole run: a minibatch's token count changes only how many micro-batches of
each it has (one `accumulate` call each), and `warm_up` runs every shape in the run's first
step.
With `rl.shared_prompt` on or auto the rows may hold a group's prompt once before its
responses (`lrl.data.shared_prompt`): minibatches are then cut between groups, every row
carries `prefix_ids`, and the old / reference log-prob passes read the same rows, so they
and the update see one layout; the loss denominators count responses as they count
unshared sequences.

P prompts · G samples per prompt · B packed rows · T positions.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import jax
import numpy as np

from lrl import collect, collect_partial, compiles, distributed, ppo, rl
from lrl import mesh as mesh_lib
from lrl.groups import Groups
from lrl.step_setup import Live, Setup
from lrl.data import packing, shared_prompt
from lrl.rl import mismatch


# ----------------------------------------------------------------------------- shaping

def shape_overlong(groups: Groups, rl_) -> tuple[Groups, np.ndarray]:
    """DAPO's overlong handling -> (groups, [P*G] loss weight; 0 drops a sample's tokens):
    "mask" drops truncated samples from the loss; "penalty" subtracts a penalty from the
    reward that ramps from 0 to `overlong_penalty` over the last `overlong_buffer` tokens of
    the limit."""
    weight = np.ones(len(groups.completions), np.float32)
    if rl_.overlong == "none":
        return groups, weight
    if rl_.overlong == "mask":
        weight[groups.truncated] = 0.0
        return groups, weight
    if rl_.overlong == "penalty":
        lengths = np.array([len(c) for c in groups.completions], np.float32)
        start = rl_.max_new_tokens - rl_.overlong_buffer
        ramp = np.clip((lengths - start) / max(rl_.overlong_buffer, 1), 0.0, 1.0)
        penalty = (rl_.overlong_penalty * ramp).reshape(groups.rewards_PG.shape)
        return dataclasses.replace(groups, rewards_PG=(groups.rewards_PG - penalty).astype(
            np.float32)), weight
    raise ValueError(f"rl.overlong={rl_.overlong!r}; choose none, mask or penalty")


def advantages(groups: Groups, estimator: str, pad_P: int = 0) -> np.ndarray:
    """[P, G]. `pad_P`: computed over that many rows, the real groups then padding rows that
    the estimator masks out (`rl.advantages`' mask_P: the batch whitening of reinforce_pp and
    reinforce_pp_token runs over the real samples alone), so a step training fewer groups
    than the last (a partial step, or dynamic sampling short of groups) gets the advantages
    of its own samples and compiles nothing new."""
    # The model's tokens are what the loss trains (reinforce_pp_token weighs by them).
    lengths_PG = groups.model_tokens().reshape(groups.P, -1)
    rewards_PG, P = groups.rewards_PG, groups.P
    pad = ((0, max(pad_P - P, 0)), (0, 0))
    rewards_PG, lengths_PG = np.pad(rewards_PG, pad), np.pad(lengths_PG, pad)
    # ReMax's greedy rewards (`collect.with_baseline`), for an estimator that asks for them
    baseline_P = None if groups.baseline_P is None else np.pad(groups.baseline_P, pad[0])
    return np.asarray(rl.advantages(rewards_PG, estimator=estimator, lengths_PG=lengths_PG,
                                    mask_P=np.arange(len(rewards_PG)) < P,
                                    baseline_P=baseline_P), np.float32)[:P]


def process_share(P: int) -> np.ndarray:
    """[P] bool: the prompts whose samples this process packs and feeds. Every process
    sampled and scored the same global prompts."""
    n, i = jax.process_count(), jax.process_index()
    per = P // n
    mine = np.zeros(P, bool)
    mine[i * per:(i + 1) * per] = True
    return mine


# ----------------------------------------------------------------------------- update rows

@dataclasses.dataclass
class Minibatch:
    """One optimizer step's micro-batches (on the devices), the loss denominators of the whole
    minibatch (over every process) and what the forward reads besides tokens."""
    micro: list
    denoms: object
    extra: object
    tokens: int          # real tokens in this process's micro-batches
    slots: int           # positions computed: rows x length of this process's micro-batches
    shared: int = 0      # samples whose prompt is held once for their group (shared layout)
    measured: int = 0    # micro-batches whose update forward measures the mismatch


def pack(s: Setup, groups: Groups, adv_PG: np.ndarray, weight: np.ndarray,
         samples: np.ndarray):
    """The `samples` (flat indices p*G + g) packed best-fit into rows of `s.row_len`; the loss
    mask covers completion tokens (times the overlong weight); the sampler's log-probs ride
    along as old log-probs when they serve; the task adds its own row arrays. With
    `rl.shared_prompt` on or auto, the groups it picks hold their prompt once per row
    (`lrl.data.shared_prompt`), and the rows always carry `prefix_ids` (all 0 when nothing
    is shared), so the update sees one set of arrays and compiles once. -> (rows, layout,
    forward extra)."""
    G = groups.group_size
    sample_prompts = [groups.prompts[i // G] for i in samples]
    comps = [groups.completions[i] for i in samples]
    # The loss covers the tokens the model sampled: a trajectory's observations are attended,
    # never trained (the model mask, `Groups.masks`).
    token_values = {"completion_weight": [weight[i] * groups.model_mask(i) for i in samples]}
    if s.rl.old_logp == "sampler":
        token_values["old_logp"] = [groups.logps[i] for i in samples]
    seq_values = {"advantages": adv_PG.reshape(-1)[samples]}
    correction_values(s.rl, groups, samples, token_values, seq_values)
    if s.rl.needs_ppo_pass:   # advantages come after the rows' forward pass (`lrl.ppo`)
        ppo.pack_values(samples, groups.rewards_PG.reshape(-1), groups.completions,
                        token_values, seq_values)
    ids = [p.ids for p in sample_prompts]
    kw = dict(seq_values=seq_values, token_values=token_values, truncate=True,
              max_segments=s.max_segments, cut=_cut(s))
    if s.rl.shared_prompt == "off":
        rows, layout = packing.pack(ids, comps, s.row_len, fit="best", **kw)
    else:
        group_of = np.asarray(samples) // G
        share = shared_prompt.share_groups(group_of, [len(x) for x in ids],
                                           [len(c) for c in comps], s.rl.shared_prompt)
        rows, layout = shared_prompt.pack_groups(ids, comps, s.row_len, groups=group_of,
                                                 share=share, **kw)
    rows["loss_mask"] = rows["loss_mask"] * rows.pop("completion_weight")
    rows, extra = s.task.update_inputs(rows, layout, sample_prompts)
    return rows, layout, extra


def correction_values(rl_, groups: Groups, samples: np.ndarray, token_values: dict,
                      seq_values: dict) -> None:
    """Adds to `pack`'s values what the mismatch metrics and the rollout correction read:
    the sampler's log-probs (`rollout_logp`), each token's 1-based position in its response
    (`response_pos`, 0 off responses: the mismatch buckets) and each sample's age
    (`sample_age`, for the staleness weight)."""
    if rl_.carries_rollout_logp:
        token_values["rollout_logp"] = [groups.logps[i] for i in samples]
    if rl_.mismatch_fraction > 0:   # 0 on observation tokens: the sampler drew none of them
        token_values["response_pos"] = [np.arange(1, len(groups.completions[i]) + 1,
                                                  dtype=np.float32) * groups.model_mask(i)
                                         for i in samples]
    if rl_.loss.weighs_staleness:
        seq_values["sample_age"] = groups.sample_ages()[samples].astype(np.float32)


def _cut(s: Setup) -> packing.Cut:
    """How this process's rows go into micro-batches: over its own data shards."""
    return packing.Cut(max(1, s.shards // jax.process_count()), s.rows_per_shard,
                       (s.row_len,) + tuple(s.buckets))


def minibatches(s: Setup, groups: Groups, adv_PG: np.ndarray, weight: np.ndarray):
    """This process's samples cut into `rl.minibatches` minibatches of samples, each packed
    and cut into micro-batches of the run's shapes, placed on the devices. -> (list of
    Minibatch, truncated sample count)."""
    cut = _cut(s)
    parts, truncated = [], 0
    for samples in minibatch_samples(groups.P, groups.group_size, s.rl.minibatches,
                                     whole_groups=s.rl.shared_prompt != "off"):
        rows, layout, extra = pack(s, groups, adv_PG, weight, samples)
        truncated += layout["num_truncated"]
        # Every process runs the same sequence of micro-batch shapes: one plan from all.
        plan = packing.micro_plan(rows, cut)
        if jax.process_count() > 1:
            plan = packing.common_plan(distributed.allgather_objects(plan), cut)
        parts.append((packing.micro_batches(rows, cut, plan=plan), extra,
                      int(layout.get("shared", np.zeros(0, bool)).sum())))
    measured = (_measured_micro_batches(s.rl.mismatch_fraction, [m for m, _, _ in parts])
                if s.rl.update_measures_mismatch else 0)
    out = []
    for k, (micro, extra, shared) in enumerate(parts):
        denoms = _global_denominators(micro, s.max_len)
        tokens = int(sum((mb["segment_ids"] > 0).sum() for mb in micro))
        out.append(Minibatch([mesh_lib.put_batch(s.mesh, mb) for mb in micro], denoms, extra,
                             tokens, sum(mb["tokens"].size for mb in micro), shared,
                             measured if k == 0 else 0))
    return out, truncated


def _measured_micro_batches(fraction: float, micro_per_minibatch: list[list[dict]]) -> int:
    """Keeps `response_pos` (what makes the update measure the mismatch, `lrl.rl.update`) in
    a `fraction` share of the step's micro-batches, rounded up, spread evenly over the first
    minibatch's, the only ones that run under the weights that sampled (at most all of it),
    and zeroes it in the rest (in place: these are the host rows before placement). The
    measure is free there, so the share only bounds it. -> how many keep it."""
    first = micro_per_minibatch[0]
    total = sum(len(m) for m in micro_per_minibatch)
    n = min(len(first), math.ceil(fraction * total))
    keep = set(np.linspace(0, len(first) - 1, n).round().astype(int).tolist()) if n else set()
    for i, mb in enumerate(mb for m in micro_per_minibatch for mb in m):
        if i not in keep:
            mb["response_pos"] = np.zeros_like(mb["response_pos"])
    return len(keep)


def warm_up(s: Setup, live: Live, params, batches: list[Minibatch]) -> None:
    """Runs each micro-batch shape the run may take and has not run yet once, on empty rows
    (segment 0: no loss, no gradient), through the log-prob passes, the mismatch sums and
    the update's accumulation (into an accumulator then dropped: no optimizer step), so that
    every program compiles all its shapes in the run's first step, not in whichever later
    step first needs one (`live.warmed`: the shapes run so far). The step's metrics see
    nothing of it."""
    from lrl.rl.update import compile_shapes
    if s.ahead is not None:   # the shapes compiling since the build: theirs, not again here
        s.ahead.wait()
    cut = _cut(s)
    seen = {mb["tokens"].shape for b in batches for mb in b.micro}
    ahead = [(cut.shards * k, n) for k, n in cut.shapes()
             if (cut.shards * k, n) not in live.warmed | seen]
    live.warmed.update(seen, ahead)
    if not ahead or not batches:
        return
    b = batches[0]
    empty = [mesh_lib.put_batch(s.mesh, {k: np.zeros((B,) + x.shape[1:-1] + (T,), x.dtype)
                                         for k, x in b.micro[0].items()}) for B, T in ahead]
    w = old_and_ref_logps(s, params, [dataclasses.replace(b, micro=empty)], live.ppo)
    mismatch_metrics(s, w)
    if live.ppo is not None:
        ppo.warm(live.ppo, params, w)
    compile_shapes(s.update, params, loss_inputs(s, w)[0].micro, b.denoms, b.extra)


def minibatch_samples(P: int, G: int, k: int, whole_groups: bool) -> list[np.ndarray]:
    """The flat sample indices (p*G + g) of each of `k` minibatches. `whole_groups` (the
    shared-prompt layout) cuts only between groups, so a group's prompt is held once in one
    minibatch rather than once in each part it was cut into; when k divides P this is the
    same cut as by samples. With fewer groups than minibatches the cut is by samples, and
    each part of a group shares its prompt within its minibatch."""
    if not whole_groups or P < k:
        return np.array_split(np.arange(P * G), k)
    return [np.arange(part[0] * G, (part[-1] + 1) * G)
            for part in np.array_split(np.arange(P), k)]


def micro_batch_spec(s_rl, task, mesh, rows: int, T: int, kl: bool) -> dict:
    """The arrays of one micro-batch as the update receives them (ShapeDtypeStructs with
    their shardings): what the update is compiled for, before any step has run."""
    ints = ("tokens", "positions", "segment_ids", "targets") + (
        ("prefix_ids",) if s_rl.shared_prompt != "off" else ())
    keys = {k: ((rows, T), np.int32) for k in ints}
    keys.update({k: ((rows, T), np.float32) for k in ("loss_mask", "advantages")})
    if s_rl.old_logp != "none":
        keys["old_logp"] = ((rows, T), np.float32)
    if s_rl.loss.corrects_rollout or (s_rl.update_measures_mismatch
                                      and s_rl.carries_rollout_logp):
        keys["rollout_logp"] = ((rows, T), np.float32)
    if s_rl.update_measures_mismatch:
        keys["response_pos"] = ((rows, T), np.float32)
    if s_rl.loss.weighs_staleness:
        keys["sample_age"] = ((rows, T), np.float32)
    if kl:
        keys["ref_logp"] = ((rows, T), np.float32)
    keys.update(task.row_specs(rows, T))
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=(
        mesh_lib.row_sharding(mesh, np.zeros((1,) * len(shape))) if mesh is not None else None))
        for k, (shape, dtype) in keys.items()}


def _global_denominators(micro, max_len):
    """The minibatch's loss denominators over every process's micro-batches."""
    from lrl.rl.update import host_denominators
    d = host_denominators(micro, max_len)
    if jax.process_count() == 1:
        return d
    parts = distributed.allgather_objects((float(d.tokens), float(d.sequences)))
    tokens, sequences = (sum(p[i] for p in parts) for i in (0, 1))
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return type(d)(f32(tokens), f32(sequences),
                   f32(sequences * (max_len if max_len is not None else np.nan)))


def old_and_ref_logps(s: Setup, params, batches: list[Minibatch],
                      p: Optional[ppo.PPO] = None) -> list[Minibatch]:
    """Each micro-batch with the old policy's log-probs (when a trainer forward gives them),
    the reference's (with KL) and the critic's old values (PPO's `p`, with a critic), taken
    in one pass over the micro-batches before any update of this step."""
    critic = p is not None and p.critic is not None
    if s.rl.old_logp != "trainer" and s.ref_params is None and not critic:
        return batches
    out = []
    for b in batches:
        micro = []
        for mb in b.micro:
            mb = dict(mb)
            if s.rl.old_logp == "trainer":
                mb["old_logp"] = s.logprobs(params, mb, b.extra)
            if s.ref_params is not None:
                mb["ref_logp"] = s.logprobs(s.ref_params, mb, b.extra)
            if critic:
                mb = ppo.old_values(p, mb, b.extra)
            micro.append(mb)
        out.append(dataclasses.replace(b, micro=micro))
    return out


# The mismatch sums of one micro-batch on the devices (its scalars leave them once a step).
_mismatch_sums = jax.jit(mismatch.row_sums)


def mismatch_metrics(s: Setup, batches: list[Minibatch]) -> dict:
    """The sampler's log-probs against the trainer's for the same tokens, before any update
    of this step (lrl.rl.mismatch), where the old log-probs come from a trainer forward: over
    every micro-batch, from them. Otherwise the update's first minibatch measures it in its
    own forward (`updates`), and this is empty. With temperature != 1, top-k or top-p the
    sampler's log-probs are those of the distribution it drew from, so the numbers include
    that difference too."""
    if s.rl.mismatch_fraction == 0 or s.rl.old_logp != "trainer":
        return {}   # none, or the update's forward measures it (`updates`)
    micro = [mb for b in batches for mb in b.micro]
    t0 = time.time()
    sums = [_mismatch_sums(mb["old_logp"], mb["rollout_logp"], mb["response_pos"])
            for mb in micro]
    total = None
    for part in jax.device_get(sums):
        total = part if total is None else mismatch.combine_sums(total, part)
    out = mismatch.finalize(total) if total is not None else {}
    out.update({"mismatch/micro_batches": len(micro), "time/mismatch_s": time.time() - t0})
    return out


def loss_inputs(s: Setup, batches: list[Minibatch]) -> list[Minibatch]:
    """The micro-batches without the arrays only the metrics read (the update's inputs stay
    those it was compiled for)."""
    drop = set() if s.rl.update_measures_mismatch else (
        {"response_pos"} | ({"rollout_logp"} if not s.rl.loss.corrects_rollout else set()))
    if s.rl.needs_ppo_pass:   # the pass's arrays; the reference's too when only the reward read it
        drop |= set(ppo.PASS_KEYS) | (
            {"ref_logp"} if not s.update.objective.loss_cfg.kl_coef else set())
    if not drop:
        return batches
    return [dataclasses.replace(b, micro=[{k: v for k, v in mb.items() if k not in drop}
                                          for mb in b.micro]) for b in batches]


def updates(s: Setup, state, batches: list[Minibatch]):
    """epochs x minibatches optimizer steps; the metrics are the last one's, with the
    mismatch the first one measured in its forward (`rl.update_measures_mismatch`: it alone
    runs under the weights that sampled)."""
    from lrl.rl.update import mismatch_of, run_update
    metrics, sums = None, None
    for _ in range(s.rl.epochs):
        for b in batches:
            state, metrics = run_update(s.update, state, b.micro, b.denoms, b.extra)
            metrics, measured = mismatch_of(metrics)
            sums = measured if sums is None else sums
    metrics = jax.device_get(metrics)
    if sums:
        metrics.update(mismatch.finalize(jax.device_get(sums)))
        metrics["mismatch/micro_batches"] = batches[0].measured
    return state, metrics


# ----------------------------------------------------------------------------- one step

def step(s: Setup, live: Live, state, it, step_index: int, carry: Optional[tuple] = None):
    """One GRPO step -> (new state, metrics, the step's groups, the groups carried to the next
    step: `lrl.rollout.partial.Pending`s with `rollout.partial`, else None). A partial step
    whose budget ended before any group finished trains nothing."""
    before = compiles.snapshot()
    if s.rollout.partial:
        groups, m, carry = collect_partial.collect_partial(s, state.params, it, step_index,
                                                           carry or ())
    else:
        groups, m = collect.collect(s, state.params, it, step_index)
    state, m = learn(s, live, state, groups, m, before)
    return state, m, groups, carry


def learn(s: Setup, live: Live, state, groups: Groups, m: dict,
          before: Optional[dict] = None):
    """The step's training half on scored `groups` (whoever sampled them: `collect.collect` in
    the same step, or the one-step-off pipeline a step ahead) -> (new state, `m` with the
    update's metrics; `live` as the step leaves it). `before`: the compile counts the step's
    count starts from."""
    before = compiles.snapshot() if before is None else before
    if s.decode is not None:
        s.decode.release()   # where memory binds, the update gets the decode weights' room
    if not groups.P:
        m.update({"compiles/step": sum(compiles.since(before).values()),
                  "compiles/total": compiles.total()})
        return state, m
    groups, weight = shape_overlong(groups, s.rl)
    # A partial step trains however many groups finished (and dynamic sampling may come up
    # short of groups): one shape for all of them.
    adv_PG = (advantages(groups, s.rl.estimator, pad_P=s.rl.prompts_per_step)
              if live.ppo is None else np.zeros(groups.rewards_PG.shape, np.float32))
    mine = process_share(groups.P)
    local = groups.take(mine)
    batches, truncated = minibatches(s, local, adv_PG[mine],
                                     weight[np.repeat(mine, groups.group_size)])
    t0 = time.time()
    warm_up(s, live, state.params, batches)
    t_warm = time.time() - t0
    t0 = time.time()
    batches = old_and_ref_logps(s, state.params, batches, live.ppo)
    jax.block_until_ready([mb.get("old_logp") for b in batches for mb in b.micro])
    t_logp = time.time() - t0
    m.update(mismatch_metrics(s, batches))
    if live.ppo is not None:
        batches, adv_PG = ppo_advantages(s, live.ppo, groups, mine, batches, m)
        if live.ppo.critic is not None:
            m.update(ppo.critic_updates(live.ppo, batches))
    batches = loss_inputs(s, batches)
    t0 = time.time()
    if live.ppo is None or live.ppo.actor_learns:
        state, um = updates(s, state, batches)
        m.update(um)
    else:   # the critic's warm-up: the actor's shapes compile now, not when it first learns
        _compile_seen(s, state.params, batches)
    if live.ppo is not None:
        ppo.end_step(live.ppo, m, groups.P * groups.group_size)
    tokens, slots = sum(b.tokens for b in batches), sum(b.slots for b in batches)
    lengths = [len(p.ids) + len(c) for p, c in
               zip((local.prompts[i // local.group_size] for i in range(len(local.completions))),
                   local.completions)]
    m.update({"time/update_s": time.time() - t0, "time/logprob_s": t_logp,
              # the first step's other shapes, compiled ahead (0 once all have run)
              "time/warm_up_s": t_warm,
              # sum of squared sequence lengths: what the update's attention FLOPs grow with
              "pack/seq_len_sq": float(np.sum(np.square(lengths, dtype=np.float64))),
              # GAE's per-token advantages set their own (`lrl.ppo.gae_advantages`)
              "advantage/abs_mean": m.get("advantage/abs_mean", float(np.abs(adv_PG).mean())),
              "pack/micro_batches": sum(len(b.micro) for b in batches),
              # the micro-batch's shape: rows of this many tokens (shorter tail buckets aside)
              "pack/row_len": s.row_len, "pack/rows_per_micro": s.rows_per_shard * s.shards,
              "pack/tokens": tokens, "pack/fill": tokens / max(slots, 1),
              "pack/truncated": truncated,
              # samples whose group's prompt their rows hold once (rl.shared_prompt)
              "pack/shared_frac": sum(b.shared for b in batches) / max(len(lengths), 1),
              # programs compiled in this step (0 once the run's shapes are all known)
              "compiles/step": sum(compiles.since(before).values()),
              "compiles/total": compiles.total()})
    return state, m


def _compile_seen(s: Setup, params, batches: list[Minibatch]) -> None:
    """The actor's accumulate on one micro-batch of each shape the step has (no optimizer
    step): a step of the critic's warm-up trains no actor, but compiles what it will run."""
    from lrl.rl.update import compile_shapes
    first = {}
    for b in batches:
        for mb in b.micro:
            first.setdefault(mb["tokens"].shape, (mb, b))
    for mb, b in first.values():
        compile_shapes(s.update, params, [mb], b.denoms, b.extra)


def ppo_advantages(s: Setup, p: ppo.PPO, groups: Groups, mine: np.ndarray,
                   batches: list[Minibatch], m: dict):
    """The advantages of PPO's pass (`lrl.ppo`), written into the rows: GAE from the critic's
    values, or the outcome estimator on scores less beta x each sample's summed KL. ->
    (batches, [P, G] advantages for the metrics: the outcome ones, or 0 with GAE)."""
    adv_PG = np.zeros(groups.rewards_PG.shape, np.float32)
    if p.critic is not None:
        batches, pm = ppo.gae_advantages(p, batches)
        m.update(pm)
        return batches, adv_PG
    from lrl.rl.kl import kl_in_score
    G = groups.group_size
    kl_local, km = ppo.sample_kl_sums(p, batches, int(mine.sum()) * G)
    kl_all = ppo.all_samples(kl_local)
    if kl_all.size != groups.rewards_PG.size:
        raise ValueError(f"rl.kl_in_reward: {kl_all.size} samples' KL for {groups.P} x {G} "
                         "samples (rl.prompts_per_step must divide by the process count)")
    shaped = dataclasses.replace(groups, rewards_PG=kl_in_score(
        groups.rewards_PG, kl_all.reshape(groups.rewards_PG.shape), p.kl_coef))
    adv_PG = advantages(shaped, s.rl.estimator, pad_P=s.rl.prompts_per_step)
    m.update(km)
    return ppo.outcome_advantages(p, batches, adv_PG[mine].reshape(-1)), adv_PG


def pass_at_k(correct_PG: np.ndarray, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n >= k samples per prompt."""
    n = correct_PG.shape[1]
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    c = correct_PG.sum(axis=1)
    vals = [1.0 if n - ci < k else 1.0 - math.comb(n - ci, k) / math.comb(n, k) for ci in c]
    return float(np.mean(vals))


def evaluate(s: Setup, params, batches: list, k: int, temperature: float, step: int) -> dict:
    """Held-out prompts, k samples each: mean reward, pass@1 and pass@k."""
    if not batches:
        return {}
    rewards = []
    for i, raw in enumerate(batches):
        groups, _ = collect.sample_and_score(s, params, raw, group_size=k,
                                             seed=10_007 * step + i, temperature=temperature)
        rewards.append(groups.rewards_PG)
    rewards_PG = np.concatenate(rewards)
    correct = rewards_PG >= 1.0
    return {"eval/reward/mean": float(rewards_PG.mean()),
            "eval/pass@1": pass_at_k(correct, 1), f"eval/pass@{k}": pass_at_k(correct, k)}

