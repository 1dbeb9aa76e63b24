"""The collection half of a GRPO step with partial rollouts (`rollout.partial`): the driver
whose bookkeeping half is `lrl.rollout.partial` (`Pending` groups, the stop rule, ages).
`collect_partial` takes `lrl.collect.collect`'s place: `partial_rollout` decodes the groups
carried from the last step (`lrl.rollout.partial.Pending`) and a new batch under this step's
params, in rounds of one rollout each (`_decode_round`), until enough groups are complete
or its token, time or tail budget stops it; the complete groups come back with their
samples' ages and the rest are carried on. Dynamic sampling here scores the groups as they
complete, drops the uniform ones and rolls on for informative ones.

    collect_partial:  task.prepare -> partial_rollout (_decode_round per round; score and
                      informative per completed batch with dynamic sampling) -> score
                      -> with_baseline

It lives beside `lrl.collect` rather than in `lrl/rollout/`, because it reads the step's
`Setup` and scores with the reward pool, which the rollout package never imports; it samples
through `lrl.collect.run_rollout` and scores through `lrl.collect.score`.

P prompts · G samples per prompt.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

import jax
import numpy as np

from lrl import collect
from lrl.groups import Groups
from lrl.rollout import partial
from lrl.step_setup import Setup

log = logging.getLogger(__name__)


def collect_partial(s: Setup, params, it, step: int, carry: tuple) -> tuple[Groups, dict, tuple]:
    """Rollout + rewards for one step of partial rollouts: batches of new prompts join the
    carried groups until the unfinished samples fill the slots (at most a step's samples)
    and, waiting behind them, `rollout.partial_backlog` times a step's samples (`backlog`),
    unless the carried groups alone hold `rl.prompts_per_step` complete ones; the complete
    groups are scored.
    -> (groups, metrics, carry). The waiting samples refill the slots that the step's
    finishing samples free, so the rollout is not left decoding a draining batch (the tail)
    before its groups are done; they hold no pages until admitted.

    With `rl.dynamic_sampling`, the rollout scores the groups as they complete and drops
    those whose rewards are all equal (`partial_rollout`'s keep_fn), drawing more batches
    while it is short of informative groups; the metrics are the synchronous path's
    (`collect`) over the groups scored this step, kept or dropped: groups/informative_frac,
    groups/draws (batches of new prompts drawn), groups/kept, and the reward/ and response/
    metrics; partial/dropped_uniform_groups counts the groups dropped."""
    new, m, draws = [], {}, 0
    complete = sum(g.complete for g in carry)
    unfinished = sum(not x.done for g in carry for x in g.samples)
    want = backlog(s.rollout, s.rl)
    while (complete < s.rl.prompts_per_step and unfinished < want
           and (s.rollout.partial_backlog > 0 or not draws)):
        batch, bm = s.task.prepare(params, next(it))
        new, m = new + batch, m or bm
        unfinished += len(batch) * s.rl.group_size
        draws += 1
    scored, reward_stats, score_s = [], {}, [0.0]

    def more() -> list:
        nonlocal draws
        draws += 1
        return s.task.prepare(params, next(it))[0]

    def keep(groups: Groups):
        t0 = time.time()
        groups, rs = collect.score(groups, s.pool, s.tokenizer)
        score_s[0] += time.time() - t0
        _add_reward_stats(reward_stats, rs)
        scored.append(groups)
        return groups, collect.informative(groups.rewards_PG)

    dynamic = s.rl.dynamic_sampling
    stats = {}
    t0 = time.time()
    groups, carry, pm = partial_rollout(s, params, carry, new, step,
                                        seed=s.seed * 1_000_003 + step * 101, stats=stats,
                                        keep_fn=keep if dynamic else None,
                                        more_fn=more if dynamic else None)
    m["time/rollout_s"] = time.time() - t0 - score_s[0]
    m["rollout/sp_prefill"] = float(s.prefill is not None)   # as the synchronous path's
    m.update(pm)
    m.update({f"rollout/{k}": v for k, v in stats.items() if np.isscalar(v)})
    if dynamic:
        all_scored = Groups.concat(scored) if scored else None
        if all_scored is not None and all_scored.P:
            m.update(reward_stats)
            m.update(collect.rollout_metrics(all_scored))
            m["groups/informative_frac"] = float(
                collect.informative(all_scored.rewards_PG).mean())
            if not groups.P:
                log.warning("dynamic sampling: all %d groups scored in step %d had equal "
                            "rewards", all_scored.P, step)
        m.update({"groups/draws": draws, "groups/kept": groups.P})
    elif groups.P:
        groups, reward_stats = collect.score(groups, s.pool, s.tokenizer)
        m.update(reward_stats)
        m.update(collect.rollout_metrics(groups))
    groups, m = collect.with_baseline(s, params, groups, m,
                                      seed=s.seed * 1_000_003 + step * 101)
    return groups, m, carry


def backlog(ro, rl_) -> int:
    """Unfinished samples a partial step's rollout starts with at least: enough to fill the
    slots (or a step's samples, where the slots hold more: in-flight work stays bounded by
    what the steps train) and `rollout.partial_backlog` x a step's samples more, the slots'
    refills while the step's groups finish. With 0, one batch is drawn while the slots are
    not full (the slots then drain before the step stops)."""
    step = rl_.prompts_per_step * rl_.group_size
    return min(ro.max_slots, step) + math.ceil(ro.partial_backlog * step)


def _add_reward_stats(total: dict, this: dict) -> None:
    """`score`'s stats of a step's scoring calls as of one: counts and seconds summed, each
    term's mean weighted by the call's items."""
    n, k = total.get("reward/n_items", 0.0), this.get("reward/n_items", 0.0)
    for key, v in this.items():
        if key.startswith("reward/term_mean/"):
            total[key] = (total.get(key, 0.0) * n + v * k) / max(n + k, 1.0)
        else:
            total[key] = total.get(key, 0.0) + v


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
    """One rollout (`rollout.run`) of the unfinished samples of `pending` (drawn by policy version
    `step`), stopped once `target` groups are complete, `tokens` are sampled or `seconds`
    have passed (0: no such budget; `partial.stop_rule`) or in the tail. -> (pending after
    it, the carried samples' tokens prefilled again). Trajectories (`rollout.env`):
    `lrl.partial_turns.decode_round`."""
    ro = s.rollout
    if ro.env:
        from lrl import partial_turns
        return partial_turns.decode_round(s, params, pending, step, target, tokens=tokens,
                                          seconds=seconds, seed=seed, stats=stats)
    ids, counts, max_new, index = partial.requests(pending, s.rl.max_new_tokens)
    samples = [(pending[i].prompt.ids, j, pending[i].samples[j].tokens.size)
               for per in index for i, j in per]
    res = collect.run_rollout(
        s, params, ids, group_size=s.rl.group_size, seed=seed, stats=stats, samples=samples,
        samples_per_prompt=counts, max_new_per_prompt=max_new,
        stop_fn=partial.stop_rule(pending, index, target, tokens, seconds),
        stop_below=math.ceil(ro.partial_tail * ro.max_slots),
        keep_kv=ro.partial_keep_kv and s.engine is not None,
        kept=[pending[per[0][0]].samples[per[0][1]].kept for per in index])
    # A request's ids past its prompt's: a carried sample's tokens, prefilled again.
    reprefill = sum(len(ids[r]) - len(pending[index[r][0][0]].prompt.ids)
                    for r in stats.get("prefilled", ()))
    return partial.advance(pending, index, res.samples, res.unfinished, step,
                           res.kept), reprefill


def _complete_groups(s: Setup, done, step: int) -> Groups:
    """Complete `Pending` groups as Groups, each sample's age counted from its oldest token."""
    if s.rollout.env:
        from lrl import partial_turns
        return partial_turns.complete_groups(s, done, step)
    samples = [x for g in done for x in g.samples]
    completions = tuple(x.tokens for x in samples)
    return Groups(tuple(g.prompt for g in done), completions, tuple(x.logps for x in samples),
                  s.rl.group_size, collect.truncated(s, completions),
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