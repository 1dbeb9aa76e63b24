"""The collection half of a GRPO step: a step's prompts -> scored groups of samples.
`collect(setup, params, it, i)` draws a batch from the task's prompt iterator, has the task
prepare it (`task.prepare`: token ids, and a video's embeddings), samples G completions of
each prompt with the run's engine (`rollout_groups`) and scores them with the host reward
functions (`score`: failures score 0 and are counted); with `rl.dynamic_sampling` it drops
the groups whose rewards are all equal (`informative`) and draws more batches, up to
`rl.max_resample` more, until `rl.prompts_per_step` informative groups are in hand.

With `rollout.partial`, `collect_partial` takes `collect`'s place: `partial_rollout` decodes
the groups carried from the last step (`lrl.rollout.partial.Pending`) and a new batch under
this step's params, in rounds of one `generate` call each (`_decode_round`), until enough
groups are complete or its token, time or tail budget stops it; the complete groups come
back with their samples' ages and the rest are carried on. Dynamic sampling there scores the
groups as they complete, drops the uniform ones and rolls on for informative ones.

    collect:          (sample_and_score: task.prepare -> rollout_groups -> score) per draw
                      -> informative -> Groups.take / Groups.concat
    collect_partial:  task.prepare -> partial_rollout (_decode_round per round; score and
                      informative per completed batch with dynamic sampling) -> score

What comes out is `Groups` (frozen), which the learning half (`lrl.grpo.learn`) trains on in
the same step or, in the one-step-off pipeline (`lrl.pipeline`), one step later; held-out
evaluation (`lrl.grpo.evaluate`) samples through `sample_and_score` too. Both halves read
`lrl.step_setup.Setup`, what every step uses.

P prompts · G samples per prompt.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Optional

import jax
import numpy as np

from lrl import rollout
from lrl.rl import registry
from lrl.rollout import partial
from lrl.step_setup import Setup
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
    # [P] the reward of one greedy sample per prompt, when the estimator asks for a baseline
    # (ReMax; `with_baseline`): scored, never trained on
    baseline_P: Optional[np.ndarray] = None
    # [P*G] int8 arrays, one per completion: 1 on tokens the model sampled, 0 on a multi-turn
    # trajectory's observation tokens (attended, never trained); () = every token sampled
    masks: tuple = ()
    # [P*G] dicts of a multi-turn trajectory's own numbers (`lrl.trajectories`); () = none
    trajectories: tuple = ()

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
                      None if self.ages is None else self.ages[flat],
                      None if self.baseline_P is None else self.baseline_P[keep],
                      pick(self.masks), pick(self.trajectories))

    @staticmethod
    def concat(parts: list["Groups"]) -> "Groups":
        cat = lambda name: tuple(x for g in parts for x in getattr(g, name))  # noqa: E731
        rewards = [g.rewards_PG for g in parts]
        ages = None if all(g.ages is None for g in parts) else np.concatenate(
            [g.sample_ages() for g in parts])
        baselines = [g.baseline_P for g in parts]
        return Groups(cat("prompts"), cat("completions"), cat("logps"), parts[0].group_size,
                      np.concatenate([g.truncated for g in parts]), cat("texts"),
                      None if any(r is None for r in rewards) else np.concatenate(rewards),
                      ages,
                      None if any(b is None for b in baselines) else np.concatenate(baselines),
                      _cat_optional(parts, "masks"), _cat_optional(parts, "trajectories"))

    def model_mask(self, i: int) -> np.ndarray:
        """[len(completions[i])] float32: 1 on the tokens sample `i`'s model sampled."""
        if not self.masks:
            return np.ones(len(self.completions[i]), np.float32)
        return np.asarray(self.masks[i], np.float32)

    def model_tokens(self) -> np.ndarray:
        """[P*G] how many tokens of each completion the model sampled (what the loss trains)."""
        if not self.masks:
            return np.array([len(c) for c in self.completions], np.int64)
        return np.array([int(np.asarray(m).sum()) for m in self.masks], np.int64)

    def sample_ages(self) -> np.ndarray:
        """[P*G] each sample's age in policy versions (0 when none was given)."""
        if self.ages is None:
            return np.zeros(len(self.completions), np.int32)
        return np.asarray(self.ages)


def _cat_optional(parts: list[Groups], name: str) -> tuple:
    """A per-sample tuple that some parts may leave empty (single-turn groups): joined, with
    the empty parts' filled in (all-ones masks; empty trajectory records)."""
    if all(not getattr(g, name) for g in parts):
        return ()
    fill = {"masks": lambda g: tuple(np.ones(len(c), np.int8) for c in g.completions),
            "trajectories": lambda g: ({},) * len(g.completions)}[name]
    return tuple(x for g in parts for x in (getattr(g, name) or fill(g)))


# ----------------------------------------------------------------------------- rollout

def _generate(s: Setup, params, ids: list, **kw) -> list:
    """`_rollout`'s samples: [P][G] (tokens, log-probs)."""
    return _rollout(s, params, ids, **kw).samples


def _rollout(s: Setup, params, ids: list, *, group_size: int, seed: int,
             temperature: Optional[float] = None, stats: Optional[dict] = None,
             samples: Optional[list] = None, **kw) -> rollout.Result:
    """The scheduler (`rollout.run`) on the run's engine (or one sized for the call) with the
    run's sampling settings; `kw` are `rollout.Request`'s fields. `samples`: for each sample
    id in order (they run on over the requests), (its group's prompt ids, its index in the
    group, the tokens it has): the key of a benchmark's forced length (`Setup.max_new_fn`,
    the request's `max_new_fn`); by default every request is a fresh group of `group_size`."""
    rl_, ro = s.rl, s.rollout
    forced = None
    if s.max_new_fn is not None:
        who = samples if samples is not None else [(p, g, 0) for p in ids
                                                   for g in range(group_size)]
        forced = lambda sid: max(1, s.max_new_fn(  # noqa: E731
            (np.asarray(who[sid][0], np.int32).tobytes(), who[sid][1])) - who[sid][2])
    temperature = rl_.temperature if temperature is None else temperature
    request = rollout.Request(
        ids, rl_.max_new_tokens, group_size, seed,
        rollout.SamplingParams(float(temperature), int(rl_.top_k), float(rl_.top_p)),
        s.eos_ids, max_new_fn=forced, **kw)
    engine = s.engine if s.engine is not None else rollout.engine_for(
        s.model_cfg, request, mesh=s.mesh, page_size=ro.page_size, max_slots=ro.max_slots,
        pool_tokens=ro.pool_tokens or None)
    return rollout.run(
        engine, params, request, stats=stats, prefill_fn=s.prefill,
        policy=rollout.Policy(overlap_admission=ro.overlap_admission),
        decode_params=s.decode.refresh(params) if s.decode is not None else None)


def _truncated(s: Setup, completions) -> np.ndarray:
    """[N] bool: the sample hit max_new_tokens without an end token."""
    eos = set(int(e) for e in s.eos_ids)
    return np.array([len(c) >= s.rl.max_new_tokens and (len(c) == 0 or int(c[-1]) not in eos)
                     for c in completions], bool)


def rollout_groups(s: Setup, params, prompts: list[Prompt], *, group_size: int, seed: int,
                   temperature: Optional[float] = None, stats: Optional[dict] = None) -> Groups:
    """G samples of every prompt (trajectories of several turns with `rollout.env`:
    `lrl.trajectories`)."""
    if s.rollout.env:
        from lrl import trajectories
        return trajectories.rollout_groups(s, params, prompts, group_size=group_size,
                                           seed=seed, temperature=temperature, stats=stats)
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
    """One rollout (`rollout.run`) of the unfinished samples of `pending` (drawn by policy version
    `step`), stopped once `target` groups are complete, `tokens` are sampled or `seconds`
    have passed (0: no such budget; `partial.stop_rule`) or in the tail. -> (pending after
    it, the carried samples' tokens prefilled again)."""
    ro = s.rollout
    ids, counts, max_new, index = partial.requests(pending, s.rl.max_new_tokens)
    samples = [(pending[i].prompt.ids, j, pending[i].samples[j].tokens.size)
               for per in index for i, j in per]
    res = _rollout(s, params, ids, group_size=s.rl.group_size, seed=seed, stats=stats,
                   samples=samples, samples_per_prompt=counts, max_new_per_prompt=max_new,
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
    """Rewards [P, G] from the host reward functions; failures score 0 and are counted.
    Multi-turn trajectories were scored by their environments (`lrl.trajectories`): their
    rewards are those, their texts their model tokens'."""
    G = groups.group_size
    if groups.trajectories:
        texts = tuple(tokenizer.decode(c[np.asarray(m) > 0], skip_special_tokens=True)
                      for c, m in zip(groups.completions, groups.masks))
        rewards_PG = np.asarray([t["env_reward"] for t in groups.trajectories],
                                np.float32).reshape(groups.P, G)
        return dataclasses.replace(groups, texts=texts, rewards_PG=rewards_PG), {}
    texts = tuple(tokenizer.decode(c, skip_special_tokens=True) for c in groups.completions)
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
    m["rollout/sp_prefill"] = float(s.prefill is not None)   # as the synchronous path's
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
    groups, m = with_baseline(s, params, groups, m, seed=s.seed * 1_000_003 + step * 101)
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
            return with_baseline(s, params, groups, m, seed)
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
    return with_baseline(s, params, merged.take(keep_P), m, seed)


def with_baseline(s: Setup, params, groups: Groups, m: dict, seed: int) -> tuple[Groups, dict]:
    """`groups` with `baseline_P` when `rl.estimator` asks for one (ReMax): one greedy
    (temperature 0) sample of each prompt, scored by the same reward pool, not trained on;
    else `groups` as they are. -> (groups, m with reward/baseline_mean and
    time/baseline_s)."""
    if not groups.P or not registry.estimator(s.rl.estimator).needs_baseline:
        return groups, m
    t0 = time.time()
    greedy = rollout_groups(s, params, list(groups.prompts), group_size=1, seed=seed,
                            temperature=0.0)
    greedy, _ = score(greedy, s.pool, s.tokenizer)
    baseline_P = greedy.rewards_PG[:, 0].astype(np.float32)
    m.update({"reward/baseline_mean": float(baseline_P.mean()),
              "time/baseline_s": time.time() - t0})
    return dataclasses.replace(groups, baseline_P=baseline_P), m


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
        **trajectory_metrics(groups),
    }


def trajectory_metrics(groups: Groups) -> dict:
    """`lrl.trajectories.metrics` of multi-turn groups; nothing for single-turn ones."""
    if not groups.trajectories:
        return {}
    from lrl import trajectories
    return trajectories.metrics(groups)

