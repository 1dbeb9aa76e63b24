"""The collection half of a synchronous GRPO step: a step's prompts -> scored groups.
`collect(setup, params, it, i)` draws a batch from the task's prompt iterator, has the task
prepare it (`task.prepare`: token ids, and a video's embeddings), samples G completions of
each prompt with the run's engine (`rollout_groups`) and scores them with the host reward
functions (`score`: failures score 0 and are counted); with `rl.dynamic_sampling` it drops
the groups whose rewards are all equal (`informative`) and draws more batches, up to
`rl.max_resample` more, until `rl.prompts_per_step` informative groups are in hand.

    collect:  (sample_and_score: task.prepare -> rollout_groups -> score) per draw
              -> informative -> Groups.take / Groups.concat -> with_baseline

What comes out is `lrl.groups.Groups`, which the learning half (`lrl.grpo.learn`) trains on
in the same step or, in the one-step-off pipeline (`lrl.pipeline`), one step later; held-out
evaluation (`lrl.grpo.evaluate`) samples through `sample_and_score` too. With
`rollout.partial`, `lrl.collect_partial.collect_partial` takes `collect`'s place; it samples
through `run_rollout` and scores through `score` here. Both halves read
`lrl.step_setup.Setup`, what every step uses.

P prompts · G samples per prompt.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import numpy as np

from lrl import rollout
from lrl.groups import Groups
from lrl.rl import registry
from lrl.step_setup import Setup
from lrl.tasks import Prompt

log = logging.getLogger(__name__)


def _generate(s: Setup, params, ids: list, **kw) -> list:
    """`run_rollout`'s samples: [P][G] (tokens, log-probs)."""
    return run_rollout(s, params, ids, **kw).samples


def run_rollout(s: Setup, params, ids: list, *, group_size: int, seed: int,
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


def truncated(s: Setup, completions) -> np.ndarray:
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
    return Groups(tuple(prompts), completions, logps, group_size, truncated(s, completions))


def score(groups: Groups, pool, tokenizer) -> tuple[Groups, dict]:
    """Rewards [P, G] from the host reward functions; failures score 0 and are counted.
    Multi-turn trajectories were scored by their environments (`lrl.trajectories`): their
    rewards are those, plus a reward model's weighted score of the whole conversation when
    the spec has an `rm` term; their texts are their model tokens'."""
    G = groups.group_size
    if groups.trajectories:
        texts = tuple(tokenizer.decode(c[np.asarray(m) > 0], skip_special_tokens=True)
                      for c, m in zip(groups.completions, groups.masks))
        rewards = np.asarray([t["env_reward"] for t in groups.trajectories], np.float32)
        stats = {}
        if hasattr(pool, "score_trajectories"):
            from lrl import trajectories
            from lrl.rewards.model import MESSAGES_KEY
            chats = [trajectories.conversation(tokenizer, c, m, t.get("observations", ()))
                     for c, m, t in zip(groups.completions, groups.masks, groups.trajectories)]
            messages = [groups.prompts[i // G].meta[MESSAGES_KEY] for i in range(len(chats))]
            rm, stats = pool.score_trajectories(messages, chats)
            rewards = rewards + rm
        return (dataclasses.replace(groups, texts=texts, rewards_PG=rewards.reshape(groups.P, G)),
                {f"reward/{k}": v for k, v in stats.items()})
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
