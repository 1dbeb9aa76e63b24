"""The host half of a GRPO step, as one function: `step(setup, state, it, i)` collects G
samples per prompt (with dynamic sampling), scores and shapes them, turns rewards into
advantages, keeps this process's share, cuts it into minibatches of samples, packs each into
rows and micro-batches of a few fixed shapes, takes the old and reference log-probs, and
runs the updates. The device half (the update and log-prob programs, compiled once for each
micro-batch shape, and the rollout engine) is built once by the loop and handed in as
`Setup`.

Each stage is a module-level function of plain values that returns new values (`Groups` is
frozen), so the order of calls is the data flow below and each stage can be read, tested and
swapped alone:

    collect -> shape_overlong -> advantages -> process_share -> minibatches (pack, micro-
            batches, placed) -> warm_up -> old_and_ref_logps -> mismatch_metrics ->
            loss_inputs -> updates

`step` is `collect` then `learn` (everything from `shape_overlong` on), which the
one-step-off pipeline (`lrl.pipeline`) calls on a batch it sampled a step ahead.
With `rollout.partial`, `collect_partial` takes `collect`'s place: the rollout stops on its
budget and the groups still running are carried into the next step (`lrl.rollout.partial`);
the step takes them in and hands the new carry back. Dynamic sampling there drops each group
whose rewards are all equal as it completes and rolls on for informative ones.

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
import logging
import math
import time
from typing import Callable, Optional

import jax
import numpy as np

from lrl import compiles, distributed, rl, rollout
from lrl import mesh as mesh_lib
from lrl.data import packing, shared_prompt
from lrl.rl import mismatch
from lrl.rollout import partial
from lrl.tasks import Prompt

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Groups:
    """P prompts with G completions each (row-major: sample g of prompt p is p*G + g)."""
    prompts: tuple            # [P] Prompt
    completions: tuple        # [P*G] int32 arrays (ending with EOS when it finished)
    logps: tuple              # [P*G] float32 arrays: sampler log-probs of those tokens
    group_size: int
    truncated: np.ndarray     # [P*G] bool: hit max_new_tokens
    texts: tuple = ()         # [P*G] decoded completions (after `score`)
    rewards_PG: Optional[np.ndarray] = None
    # [P*G] policy versions between the parameters that sampled each completion and those
    # that train on it (the staleness weight reads it); None: all 0, a synchronous step
    ages: Optional[np.ndarray] = None

    @property
    def P(self) -> int:
        return len(self.prompts)

    def take(self, keep_P: np.ndarray) -> "Groups":
        G = self.group_size
        keep = np.flatnonzero(keep_P)
        flat = [p * G + g for p in keep for g in range(G)]
        pick = lambda xs: tuple(xs[i] for i in flat) if len(xs) else ()  # noqa: E731
        return Groups(tuple(self.prompts[p] for p in keep), pick(self.completions),
                      pick(self.logps), G, self.truncated[flat], pick(self.texts),
                      None if self.rewards_PG is None else self.rewards_PG[keep],
                      None if self.ages is None else self.ages[flat])

    @staticmethod
    def concat(parts: list["Groups"]) -> "Groups":
        cat = lambda name: tuple(x for g in parts for x in getattr(g, name))  # noqa: E731
        rewards = [g.rewards_PG for g in parts]
        ages = None if all(g.ages is None for g in parts) else np.concatenate(
            [g.sample_ages() for g in parts])
        return Groups(cat("prompts"), cat("completions"), cat("logps"), parts[0].group_size,
                      np.concatenate([g.truncated for g in parts]), cat("texts"),
                      None if any(r is None for r in rewards) else np.concatenate(rewards),
                      ages)

    def sample_ages(self) -> np.ndarray:
        """[P*G] each sample's age in policy versions (0 when none was given)."""
        if self.ages is None:
            return np.zeros(len(self.completions), np.int32)
        return np.asarray(self.ages)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every GRPO step uses, built once where the loop is built."""
    rl: object                    # options.RLOptions
    rollout: object               # options.RolloutOptions
    seed: int
    task: object                  # lrl.tasks: prepare / update_inputs
    tokenizer: object
    model_cfg: object
    mesh: object
    eos_ids: tuple
    pool: object                  # lrl.rewards.RewardPool
    update: object                # rl.update.UpdatePrograms, compiled per micro-batch shape
    logprobs: Optional[Callable]  # jitted (params, micro_batch, extra) -> logp_BT, when needed
    shards: int                   # data-parallel shards of the mesh (data x fsdp)
    row_len: int                  # T of a packed row
    rows_per_shard: int           # rows a data shard holds in one micro-batch
    max_segments: int             # sequences a row may hold (the attention's packed runs)
    max_len: Optional[int] = None # the loss's max_len (seq_mean_token_sum_norm)
    prefill: Optional[Callable] = None   # sequence-parallel prefill of long prompts
    ref_params: object = None     # the frozen reference, when KL is on
    engine: object = None         # the run's rollout engine (None: one per call, sized for it)
    decode: object = None         # rollout.weights.DecodeWeights for that engine
    # Benchmarks only: a sample's forced length, from its key (its prompt's ids as bytes, its
    # index in the group), as if its end token came there; a carried sample samples the rest.
    max_new_fn: Optional[Callable[[tuple], int]] = None
    # Row lengths below row_len a minibatch's last rows are cut to, longest first
    # (`lrl.rl.budget.row_lengths`); () cuts none.
    buckets: tuple = ()
    # The micro-batch shapes [B, T] the step's programs have run (`warm_up`).
    warmed: set = dataclasses.field(default_factory=set)


# ----------------------------------------------------------------------------- rollout

def _generate(s: Setup, params, ids: list, *, group_size: int, seed: int,
              temperature: Optional[float] = None, stats: Optional[dict] = None,
              samples: Optional[list] = None, **kw):
    """`rollout.generate` with the run's engine and sampling settings. `samples`: for each
    sample id in order (they run on over the requests), (its group's prompt ids, its index in
    the group, the tokens it has): the key of a benchmark's forced length (`max_new_fn`);
    by default every request is a fresh group of `group_size`."""
    rl_ = s.rl
    forced = None
    if s.max_new_fn is not None:
        who = samples if samples is not None else [(p, g, 0) for p in ids
                                                   for g in range(group_size)]
        forced = lambda sid: max(1, s.max_new_fn(  # noqa: E731
            (np.asarray(who[sid][0], np.int32).tobytes(), who[sid][1])) - who[sid][2])
    return rollout.generate(
        s.model_cfg, params, ids, max_new_tokens=rl_.max_new_tokens, num_samples=group_size,
        temperature=rl_.temperature if temperature is None else temperature,
        top_k=rl_.top_k, top_p=rl_.top_p, eos_ids=s.eos_ids, seed=seed,
        page_size=s.rollout.page_size, max_slots=s.rollout.max_slots,
        pool_tokens=s.rollout.pool_tokens or None, mesh=s.mesh, stats=stats,
        prefill_fn=s.prefill, engine=s.engine,
        decode_params=s.decode.refresh(params) if s.decode is not None else None,
        max_new_fn=forced, **kw)


def _truncated(s: Setup, completions) -> np.ndarray:
    """[N] bool: the sample hit max_new_tokens without an end token."""
    eos = set(int(e) for e in s.eos_ids)
    return np.array([len(c) >= s.rl.max_new_tokens and (len(c) == 0 or int(c[-1]) not in eos)
                     for c in completions], bool)


def rollout_groups(s: Setup, params, prompts: list[Prompt], *, group_size: int, seed: int,
                   temperature: Optional[float] = None, stats: Optional[dict] = None) -> Groups:
    """G samples of every prompt."""
    multimodal = prompts and prompts[0].embeds is not None
    outs = _generate(
        s, params, [p.ids for p in prompts], group_size=group_size, seed=seed,
        temperature=temperature, stats=stats,
        prompt_embeds=[p.embeds for p in prompts] if multimodal else None,
        prompt_positions=[p.positions for p in prompts] if multimodal else None)
    completions = tuple(np.asarray(ids, np.int32) for per in outs for ids, _ in per)
    logps = tuple(np.asarray(lp, np.float32) for per in outs for _, lp in per)
    return Groups(tuple(prompts), completions, logps, group_size, _truncated(s, completions))


def partial_rollout(s: Setup, params, carry: tuple, new_prompts: list, step: int, *, seed: int,
                    stats: Optional[dict] = None, keep_fn: Optional[Callable] = None,
                    more_fn: Optional[Callable[[], list]] = None
                    ) -> tuple[Groups, tuple, dict]:
    """One step's partial rollout (`lrl.rollout.partial`): the carried groups (`Pending`)
    and `new_prompts` decoded under `params` (policy version `step`) until
    `rl.prompts_per_step` groups are complete, `rollout.partial_tokens` tokens are sampled,
    `rollout.partial_seconds` have passed or the tail stops it (`rollout.partial_tail`).
    -> (the complete groups, at most prompts_per_step, oldest first, with their ages; the
    groups carried on; metrics). Groups past `rollout.max_staleness` are dropped first (and
    their samples' kept pages released). With `rollout.partial_keep_kv` and the run's engine,
    the samples still running keep their KV pages in its pool for the next step.

    Dynamic sampling, `keep_fn(groups) -> (groups scored, [P] keep)`: the complete groups are
    taken oldest first, as many as are still wanted, and scored; those it does not keep (all
    rewards equal: `informative`) are dropped and counted, and only kept groups count towards
    prompts_per_step, in the stop rule too. While fewer are kept and no budget has stopped
    the rollout (tokens and seconds over the whole step, or the tail), it decodes another
    round, at most 1 + `rl.max_resample` rounds a step (the synchronous path's cap on
    draws), each admitting a batch of `more_fn()` prompts while the unfinished samples do not
    fill the slots. The groups it returns are then scored."""
    rl_, ro = s.rl, s.rollout
    G, P, procs = rl_.group_size, rl_.prompts_per_step, jax.process_count()
    pending, gone_groups, gone_samples = partial.drop_stale(tuple(carry), step,
                                                            ro.max_staleness)
    if gone_groups and s.engine is not None:
        staying = {id(g) for g in pending}
        s.engine.release_kept(partial.kept_of(g for g in carry if id(g) not in staying))
    pending = pending + tuple(partial.Pending.fresh(p, G) for p in new_prompts)
    st = stats if stats is not None else {}
    deadline = time.monotonic() + ro.partial_seconds if ro.partial_seconds > 0 else None
    trained, kept, scored, reprefill, rounds, new_groups = [], [], 0, 0, 0, len(new_prompts)
    running = lambda: any(not g.complete for g in pending)  # noqa: E731
    while True:
        need = P - len(trained)
        if running() and sum(g.complete for g in pending) < need:
            # A later round has what is left of the step's budgets.
            tokens = ro.partial_tokens and ro.partial_tokens - st.get("sampled_tokens", 0)
            seconds = ro.partial_seconds and (max(deadline - time.monotonic(), 1e-9) if rounds
                                              else ro.partial_seconds)
            this = {}
            pending, r = _decode_round(s, params, pending, step, need, tokens=tokens,
                                       seconds=seconds, seed=seed + rounds, stats=this)
            _add_round_stats(st, this, first=not rounds)
            reprefill, rounds = reprefill + r, rounds + 1
        while need > 0 and any(g.complete for g in pending):
            n = min(need, sum(g.complete for g in pending))
            if keep_fn is None:
                # Every process trains its share of the same groups (`process_share`): a
                # multiple of them.
                done, pending = partial.take_complete(pending, n - n % procs)
                trained += done
                break
            done, pending = partial.take_complete(pending, n)
            groups, keep_P = keep_fn(_complete_groups(s, done, step))
            trained += [g for g, k in zip(done, keep_P) if k]
            kept.append(groups.take(keep_P))
            scored, need = scored + len(done), P - len(trained)
        spent = ((ro.partial_tokens and st.get("sampled_tokens", 0) >= ro.partial_tokens)
                 or (deadline is not None and time.monotonic() >= deadline)
                 or st.get("stopped_in_tail"))
        if keep_fn is None or need <= 0 or rounds > rl_.max_resample or spent:
            break
        if sum(not x.done for g in pending for x in g.samples) < ro.max_slots:
            new = more_fn()
            pending += tuple(partial.Pending.fresh(p, G) for p in new)
            new_groups += len(new)
        if not running():
            break
    if keep_fn is None:
        groups = _complete_groups(s, trained, step)
    else:   # kept groups past a multiple of the processes wait for the next step
        extra = len(trained) % procs
        if extra:
            pending, trained = tuple(trained[-extra:]) + pending, trained[:-extra]
        groups = Groups.concat(kept) if kept else _complete_groups(s, (), step)
        groups = groups.take(np.arange(groups.P) < len(trained))
    ages = groups.sample_ages()
    span = np.array([int(np.ptp(x.versions)) for g in trained for x in g.samples], np.float32)
    m = {"partial/new_groups": new_groups, "partial/trained_groups": len(trained),
         "partial/dropped_stale_groups": gone_groups,
         "partial/dropped_stale_samples": gone_samples,
         "partial/reprefill_tokens": reprefill,
         "partial/kept_samples": st.get("kept_resumed", 0),
         "partial/age_mean": float(ages.mean()) if ages.size else 0.0,
         "partial/age_max": float(ages.max()) if ages.size else 0.0,
         "partial/version_span_mean": float(span.mean()) if span.size else 0.0,
         "partial/version_span_max": float(span.max()) if span.size else 0.0,
         **partial.carried_metrics(pending, step)}
    if keep_fn is not None:
        m.update({"partial/rounds": rounds,
                  "partial/dropped_uniform_groups": scored - sum(k.P for k in kept)})
    return groups, pending, m


def _decode_round(s: Setup, params, pending: tuple, step: int, target: int, *, tokens: int,
                  seconds: float, seed: int, stats: dict) -> tuple[tuple, int]:
    """One `generate` call over the unfinished samples of `pending` (drawn by policy version
    `step`), stopped once `target` groups are complete, `tokens` are sampled or `seconds`
    have passed (0: no such budget; `partial.stop_rule`) or in the tail. -> (pending after
    it, the carried samples' tokens prefilled again)."""
    ro = s.rollout
    ids, counts, max_new, index = partial.requests(pending, s.rl.max_new_tokens)
    keep = {} if ro.partial_keep_kv and s.engine is not None else None
    unfinished = []
    samples = [(pending[i].prompt.ids, j, pending[i].samples[j].tokens.size)
               for per in index for i, j in per]
    outs = _generate(s, params, ids, group_size=s.rl.group_size, seed=seed, stats=stats,
                     samples=samples, samples_per_prompt=counts, max_new_per_prompt=max_new,
                     stop_fn=partial.stop_rule(pending, index, target, tokens, seconds),
                     stop_below=math.ceil(ro.partial_tail * ro.max_slots),
                     unfinished=unfinished, kept_out=keep,
                     kept=[pending[per[0][0]].samples[per[0][1]].kept for per in index])
    # A request's ids past its prompt's: a carried sample's tokens, prefilled again.
    reprefill = sum(len(ids[r]) - len(pending[index[r][0][0]].prompt.ids)
                    for r in stats.get("prefilled", ()))
    return partial.advance(pending, index, outs, unfinished, step, keep), reprefill


def _complete_groups(s: Setup, done, step: int) -> Groups:
    """Complete `Pending` groups as Groups, each sample's age counted from its oldest token."""
    samples = [x for g in done for x in g.samples]
    completions = tuple(x.tokens for x in samples)
    return Groups(tuple(g.prompt for g in done), completions, tuple(x.logps for x in samples),
                  s.rl.group_size, _truncated(s, completions),
                  ages=np.array([step - x.oldest() for x in samples], np.int32))


# Rollout stats a later round replaces (pool sizes, running totals) or that are ratios.
_LATEST = {"num_pages", "slots", "pages_allocated", "stopped_in_tail"}
_RATIOS = {"occupancy", "slot_occupancy", "row_occupancy"}


def _add_round_stats(total: dict, this: dict, first: bool) -> None:
    """`generate`'s stats of a step's rounds as of one rollout: counts and seconds summed,
    the peak its largest, the occupancies over all the rounds' decode steps."""
    if first:
        total.update(this)
        return
    for k, v in this.items():
        if k == "peak_pages":
            total[k] = max(total.get(k, 0), v)
        elif (isinstance(v, (int, float)) and not isinstance(v, bool) and k in total
              and k not in _LATEST | _RATIOS):
            total[k] += v
        else:
            total[k] = v
    rows = max(1, total.get("decode_steps", 0) * total.get("slots", 1))
    total.update(occupancy=total.get("new_tokens", 0) / rows,
                 slot_occupancy=total.get("sampled_tokens", 0) / rows,
                 row_occupancy=total.get("sampled_tokens", 0) / max(1, total.get(
                     "computed_rows", 0)))


def score(groups: Groups, pool, tokenizer) -> tuple[Groups, dict]:
    """Rewards [P, G] from the host reward functions; failures score 0 and are counted."""
    texts = tuple(tokenizer.decode(c, skip_special_tokens=True) for c in groups.completions)
    G = groups.group_size
    items = [(text, str(groups.prompts[i // G].answer), groups.prompts[i // G].meta)
             for i, text in enumerate(texts)]
    rewards, stats = pool.score(items)
    rewards_PG = np.asarray(rewards, np.float32).reshape(groups.P, G)
    return (dataclasses.replace(groups, texts=texts, rewards_PG=rewards_PG),
            {f"reward/{k}": v for k, v in stats.items()})


def sample_and_score(s: Setup, params, raw, *, group_size: int, seed: int,
                     temperature: Optional[float] = None) -> tuple[Groups, dict]:
    """A raw batch of the task's prompts -> scored Groups and the rollout's metrics."""
    prompts, m = s.task.prepare(params, raw)
    stats = {}
    t0 = time.time()
    groups = rollout_groups(s, params, prompts, group_size=group_size, seed=seed,
                            temperature=temperature, stats=stats)
    m["time/rollout_s"] = time.time() - t0
    groups, reward_stats = score(groups, s.pool, s.tokenizer)
    m.update(reward_stats)
    m.update({f"rollout/{k}": v for k, v in stats.items() if np.isscalar(v)})
    m["rollout/sp_prefill"] = float(s.prefill is not None)
    return groups, m


def collect_partial(s: Setup, params, it, step: int, carry: tuple) -> tuple[Groups, dict, tuple]:
    """Rollout + rewards for one step of partial rollouts: a new batch of prompts joins the
    carried groups unless those alone hold `rl.prompts_per_step` complete groups or enough
    unfinished samples to fill every slot (so the slots stay full while the in-flight work
    stays bounded); the complete groups are scored. -> (groups, metrics, carry).

    With `rl.dynamic_sampling`, the rollout scores the groups as they complete and drops
    those whose rewards are all equal (`partial_rollout`'s keep_fn), drawing more batches
    while it is short of informative groups; the metrics are the synchronous path's
    (`collect`) over the groups scored this step, kept or dropped: groups/informative_frac,
    groups/draws (batches of new prompts drawn), groups/kept, and the reward/ and response/
    metrics; partial/dropped_uniform_groups counts the groups dropped."""
    new, m, draws = [], {}, 0
    complete = sum(g.complete for g in carry)
    unfinished = sum(not x.done for g in carry for x in g.samples)
    if complete < s.rl.prompts_per_step and unfinished < s.rollout.max_slots:
        new, m = s.task.prepare(params, next(it))
        draws = 1
    scored, reward_stats, score_s = [], {}, [0.0]

    def more() -> list:
        nonlocal draws
        draws += 1
        return s.task.prepare(params, next(it))[0]

    def keep(groups: Groups):
        t0 = time.time()
        groups, rs = score(groups, s.pool, s.tokenizer)
        score_s[0] += time.time() - t0
        _add_reward_stats(reward_stats, rs)
        scored.append(groups)
        return groups, informative(groups.rewards_PG)

    dynamic = s.rl.dynamic_sampling
    stats = {}
    t0 = time.time()
    groups, carry, pm = partial_rollout(s, params, carry, new, step,
                                        seed=s.seed * 1_000_003 + step * 101, stats=stats,
                                        keep_fn=keep if dynamic else None,
                                        more_fn=more if dynamic else None)
    m["time/rollout_s"] = time.time() - t0 - score_s[0]
    m.update(pm)
    m.update({f"rollout/{k}": v for k, v in stats.items() if np.isscalar(v)})
    if dynamic:
        all_scored = Groups.concat(scored) if scored else None
        if all_scored is not None and all_scored.P:
            m.update(reward_stats)
            m.update(rollout_metrics(all_scored))
            m["groups/informative_frac"] = float(informative(all_scored.rewards_PG).mean())
            if not groups.P:
                log.warning("dynamic sampling: all %d groups scored in step %d had equal "
                            "rewards", all_scored.P, step)
        m.update({"groups/draws": draws, "groups/kept": groups.P})
    elif groups.P:
        groups, reward_stats = score(groups, s.pool, s.tokenizer)
        m.update(reward_stats)
        m.update(rollout_metrics(groups))
    return groups, m, carry


def _add_reward_stats(total: dict, this: dict) -> None:
    """`score`'s stats of a step's scoring calls as of one: counts and seconds summed, each
    term's mean weighted by the call's items."""
    n, k = total.get("reward/n_items", 0.0), this.get("reward/n_items", 0.0)
    for key, v in this.items():
        if key.startswith("reward/term_mean/"):
            total[key] = (total.get(key, 0.0) * n + v * k) / max(n + k, 1.0)
        else:
            total[key] = total.get(key, 0.0) + v


def collect(s: Setup, params, it, step: int) -> tuple[Groups, dict]:
    """Rollout + rewards for one step, with DAPO dynamic sampling when configured: groups
    whose rewards are all equal teach nothing, so more batches are drawn (up to
    `rl.max_resample` more) until `rl.prompts_per_step` informative groups are in hand."""
    rl_ = s.rl
    parts, m, draws, seconds = [], {}, 0, 0.0
    while True:
        seed = s.seed * 1_000_003 + step * 101 + draws
        groups, dm = sample_and_score(s, params, next(it), group_size=rl_.group_size,
                                      seed=seed)
        seconds += dm["time/rollout_s"]
        if not draws:
            m.update(dm)
            m.update(rollout_metrics(groups))
        m["time/rollout_s"] = seconds
        draws += 1
        if not rl_.dynamic_sampling:
            return groups, m
        keep = informative(groups.rewards_PG)
        m.setdefault("groups/informative_frac", float(keep.mean()))
        if keep.any():
            parts.append(groups.take(keep))
        if sum(p.P for p in parts) >= rl_.prompts_per_step or draws > rl_.max_resample:
            break
    if not parts:  # every group was uniform: learn nothing this step, but keep going
        log.warning("dynamic sampling: all %d groups had equal rewards after %d draws",
                    groups.P * draws, draws)
        parts = [groups]
    m["groups/draws"] = draws
    merged = Groups.concat(parts)
    keep_P = np.arange(merged.P) < rl_.prompts_per_step
    m["groups/kept"] = int(keep_P.sum())
    return merged.take(keep_P), m


def informative(rewards_PG: np.ndarray) -> np.ndarray:
    """A group whose rewards are all equal has zero advantage everywhere."""
    return rewards_PG.max(axis=1) > rewards_PG.min(axis=1)


def rollout_metrics(groups: Groups) -> dict:
    lengths = np.array([len(c) for c in groups.completions], np.float32)
    r = groups.rewards_PG
    return {
        "reward/mean": float(r.mean()), "reward/std": float(r.std()),
        "reward/max": float(r.max()), "reward/min": float(r.min()),
        "reward/group_std_mean": float(r.std(axis=1).mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(groups.truncated.mean()),
    }


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
    # The completion tokens are what the loss trains (reinforce_pp_token weighs by them).
    lengths_PG = np.array([len(c) for c in groups.completions]).reshape(groups.P, -1)
    rewards_PG, P = groups.rewards_PG, groups.P
    pad = ((0, max(pad_P - P, 0)), (0, 0))
    rewards_PG, lengths_PG = np.pad(rewards_PG, pad), np.pad(lengths_PG, pad)
    return np.asarray(rl.advantages(rewards_PG, estimator=estimator, lengths_PG=lengths_PG,
                                    mask_P=np.arange(len(rewards_PG)) < P), np.float32)[:P]


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
    token_values = {"completion_weight": [np.full(len(groups.completions[i]), weight[i],
                                                  np.float32) for i in samples]}
    if s.rl.old_logp == "sampler":
        token_values["old_logp"] = [groups.logps[i] for i in samples]
    seq_values = {"advantages": adv_PG.reshape(-1)[samples]}
    correction_values(s.rl, groups, samples, token_values, seq_values)
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
    if rl_.mismatch_fraction > 0:
        token_values["response_pos"] = [np.arange(1, len(groups.completions[i]) + 1,
                                                  dtype=np.float32) for i in samples]
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
    out, truncated = [], 0
    for samples in minibatch_samples(groups.P, groups.group_size, s.rl.minibatches,
                                     whole_groups=s.rl.shared_prompt != "off"):
        rows, layout, extra = pack(s, groups, adv_PG, weight, samples)
        truncated += layout["num_truncated"]
        # Every process runs the same sequence of micro-batch shapes: one plan from all.
        plan = packing.micro_plan(rows, cut)
        if jax.process_count() > 1:
            plan = packing.common_plan(distributed.allgather_objects(plan), cut)
        micro = packing.micro_batches(rows, cut, plan=plan)
        denoms = _global_denominators(micro, s.max_len)
        tokens = int(sum((mb["segment_ids"] > 0).sum() for mb in micro))
        out.append(Minibatch([mesh_lib.put_batch(s.mesh, mb) for mb in micro], denoms, extra,
                             tokens, sum(mb["tokens"].size for mb in micro),
                             int(layout.get("shared", np.zeros(0, bool)).sum())))
    return out, truncated


def warm_up(s: Setup, params, batches: list[Minibatch]) -> None:
    """Runs each micro-batch shape the run may take and has not run yet once, on empty rows
    (segment 0: no loss, no gradient), through the log-prob passes, the mismatch pass and
    the update's accumulation (into an accumulator then dropped: no optimizer step), so that
    every program compiles all its shapes in the run's first step, not in whichever later
    step first needs one. The step's metrics see nothing of it."""
    from lrl.rl.update import compile_shapes
    cut = _cut(s)
    seen = {mb["tokens"].shape for b in batches for mb in b.micro}
    ahead = [(cut.shards * k, n) for k, n in cut.shapes()
             if (cut.shards * k, n) not in s.warmed | seen]
    s.warmed.update(seen, ahead)
    if not ahead or not batches:
        return
    b = batches[0]
    empty = [mesh_lib.put_batch(s.mesh, {k: np.zeros((B,) + x.shape[1:-1] + (T,), x.dtype)
                                         for k, x in b.micro[0].items()}) for B, T in ahead]
    w = old_and_ref_logps(s, params, [dataclasses.replace(b, micro=empty)])
    mismatch_metrics(s, params, w, 0)
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
    if s_rl.loss.corrects_rollout:
        keys["rollout_logp"] = ((rows, T), np.float32)
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


def old_and_ref_logps(s: Setup, params, batches: list[Minibatch]) -> list[Minibatch]:
    """Each micro-batch with the old policy's log-probs (when a trainer forward gives them) and
    the reference's (with KL), taken before any update of this step."""
    if s.rl.old_logp != "trainer" and s.ref_params is None:
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
            micro.append(mb)
        out.append(dataclasses.replace(b, micro=micro))
    return out


# The mismatch sums of one micro-batch on the devices (its scalars leave them once a step);
# response_pos is 1-based, 0 off the responses.
_mismatch_sums = jax.jit(lambda trainer_BT, sampler_BT, pos_BT: mismatch.mismatch_sums(
    trainer_BT, sampler_BT, pos_BT > 0, pos_BT - 1))


def mismatch_metrics(s: Setup, params, batches: list[Minibatch], step_index: int) -> dict:
    """The sampler's log-probs against the trainer's for the same tokens, before any update
    of this step (lrl.rl.mismatch): over every micro-batch when the old log-probs come from a
    trainer forward, else over a `rl.mismatch_fraction` share of the step's micro-batches,
    drawn by the seed and step (the same on every process), that a forward pass re-scores:
    at least one of each micro-batch shape the step has, so that pass compiles a shape in
    the step whose update first compiles it, never later. With temperature != 1, top-k or
    top-p the sampler's log-probs are those of the distribution it drew from, so the numbers
    include that difference too."""
    if s.rl.mismatch_fraction == 0:
        return {}
    micro = [(b, mb) for b in batches for mb in b.micro]
    if s.rl.old_logp != "trainer":
        rng = np.random.default_rng([s.seed, step_index])
        shapes = [mb["tokens"].shape for _, mb in micro]
        pick = [int(rng.choice([i for i, x in enumerate(shapes) if x == shape]))
                for shape in sorted(set(shapes))]
        rest = [i for i in range(len(micro)) if i not in pick]
        more = math.ceil(s.rl.mismatch_fraction * len(micro)) - len(pick)
        if more > 0:
            pick += [int(i) for i in rng.choice(rest, more, replace=False)]
        micro = [micro[i] for i in sorted(pick)]
    t0 = time.time()
    # Where the sampler's log-probs serve as old log-probs, the rows carry them once.
    sums = [_mismatch_sums(mb["old_logp"] if s.rl.old_logp == "trainer"
                           else s.logprobs(params, mb, b.extra),
                           mb["rollout_logp"] if "rollout_logp" in mb else mb["old_logp"],
                           mb["response_pos"]) for b, mb in micro]
    total = None
    for part in jax.device_get(sums):
        total = part if total is None else mismatch.combine_sums(total, part)
    out = mismatch.finalize(total) if total is not None else {}
    out.update({"mismatch/micro_batches": len(micro), "time/mismatch_s": time.time() - t0})
    return out


def loss_inputs(s: Setup, batches: list[Minibatch]) -> list[Minibatch]:
    """The micro-batches without the arrays only the metrics read (the update's inputs stay
    those it was compiled for)."""
    drop = {"response_pos"} | ({"rollout_logp"} if not s.rl.loss.corrects_rollout else set())
    return [dataclasses.replace(b, micro=[{k: v for k, v in mb.items() if k not in drop}
                                          for mb in b.micro]) for b in batches]


def updates(s: Setup, state, batches: list[Minibatch]):
    """epochs x minibatches optimizer steps; the metrics are the last one's."""
    from lrl.rl.update import run_update
    metrics = None
    for _ in range(s.rl.epochs):
        for b in batches:
            state, metrics = run_update(s.update, state, b.micro, b.denoms, b.extra)
    return state, jax.device_get(metrics)


# ----------------------------------------------------------------------------- one step

def step(s: Setup, state, it, step_index: int, carry: Optional[tuple] = None):
    """One GRPO step -> (new state, metrics, the step's groups, the groups carried to the next
    step: `lrl.rollout.partial.Pending`s with `rollout.partial`, else None). A partial step
    whose budget ended before any group finished trains nothing."""
    before = compiles.snapshot()
    if s.rollout.partial:
        groups, m, carry = collect_partial(s, state.params, it, step_index, carry or ())
    else:
        groups, m = collect(s, state.params, it, step_index)
    state, m = learn(s, state, groups, m, step_index, before)
    return state, m, groups, carry


def learn(s: Setup, state, groups: Groups, m: dict, step_index: int,
          before: Optional[dict] = None):
    """The step's training half on scored `groups` (whoever sampled them: `collect` in the
    same step, or the one-step-off pipeline a step ahead) -> (new state, `m` with the update's
    metrics). `before`: the compile counts the step's count starts from."""
    before = compiles.snapshot() if before is None else before
    if not groups.P:
        m.update({"compiles/step": sum(compiles.since(before).values()),
                  "compiles/total": compiles.total()})
        return state, m
    groups, weight = shape_overlong(groups, s.rl)
    # A partial step trains however many groups finished (and dynamic sampling may come up
    # short of groups): one shape for all of them.
    adv_PG = advantages(groups, s.rl.estimator, pad_P=s.rl.prompts_per_step)
    mine = process_share(groups.P)
    local = groups.take(mine)
    batches, truncated = minibatches(s, local, adv_PG[mine],
                                     weight[np.repeat(mine, groups.group_size)])
    warm_up(s, state.params, batches)
    t0 = time.time()
    batches = old_and_ref_logps(s, state.params, batches)
    jax.block_until_ready([mb.get("old_logp") for b in batches for mb in b.micro])
    t_logp = time.time() - t0
    m.update(mismatch_metrics(s, state.params, batches, step_index))
    batches = loss_inputs(s, batches)
    t0 = time.time()
    state, um = updates(s, state, batches)
    m.update(um)
    tokens, slots = sum(b.tokens for b in batches), sum(b.slots for b in batches)
    lengths = [len(p.ids) + len(c) for p, c in
               zip((local.prompts[i // local.group_size] for i in range(len(local.completions))),
                   local.completions)]
    m.update({"time/update_s": time.time() - t0, "time/logprob_s": t_logp,
              # sum of squared sequence lengths: what the update's attention FLOPs grow with
              "pack/seq_len_sq": float(np.sum(np.square(lengths, dtype=np.float64))),
              "advantage/abs_mean": float(np.abs(adv_PG).mean()),
              "pack/micro_batches": sum(len(b.micro) for b in batches),
              "pack/tokens": tokens, "pack/fill": tokens / max(slots, 1),
              "pack/truncated": truncated,
              # samples whose group's prompt their rows hold once (rl.shared_prompt)
              "pack/shared_frac": sum(b.shared for b in batches) / max(len(lengths), 1),
              # programs compiled in this step (0 once the run's shapes are all known)
              "compiles/step": sum(compiles.since(before).values()),
              "compiles/total": compiles.total()})
    return state, m


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
        groups, _ = sample_and_score(s, params, raw, group_size=k, seed=10_007 * step + i,
                                     temperature=temperature)
        rewards.append(groups.rewards_PG)
    rewards_PG = np.concatenate(rewards)
    correct = rewards_PG >= 1.0
    return {"eval/reward/mean": float(rewards_PG.mean()),
            "eval/pass@1": pass_at_k(correct, 1), f"eval/pass@{k}": pass_at_k(correct, k)}
