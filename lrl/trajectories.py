"""Multi-turn rollouts for training (`rollout.env`): a step's prompts -> groups of trajectories.

A trajectory is one sample whose tokens after the prompt alternate model turns and
observations: the scheduler (`lrl.rollout`, `Request.turns`) pauses a sample when its model
turn ends, the environment driver (`lrl.envs.driver.Driver`, built here from the options)
steps the environment in the reward workers and hands back the observation's token ids,
which the engine prefills after the sample's KV pages before it decodes on. What the update
trains is exactly those tokens — the sampled ones and the observations as inserted, never a
re-rendering of the conversation (a template that drops earlier `<think>` blocks would change
them) — with the model mask (`Result.model_masks`) as `Groups.masks`: the loss, the rollout
correction and the mismatch metrics read model tokens only (`lrl.grpo.pack`).

The reward of a trajectory (`trajectory_reward`) is its environment's rewards, one a turn,
the last the final answer's (`lrl.envs.ToolEnv` scores it with the run's `reward.spec`, which
each row carries), summed (`rollout.turn_reward="sum"`) or discounted by
`rollout.turn_discount` per turn ("discount"); a trajectory that ends without an answer (its
token limit, `rollout.max_turns`, a timeout or an error) has no final reward. GRPO's group is
a prompt's G trajectories.

    rollout_groups: make_driver -> collect.run_rollout(turns=driver) -> driver.results()
                    -> Groups(masks, trajectories) -> collect.score (rewards = the env's)

P prompts · G samples per prompt.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

# Per-trajectory numbers kept in `Groups.trajectories` (and summed into the step's metrics).
COUNTS = ("turns", "tool_calls", "tool_errors", "timeouts", "tool_s")


def trajectory_reward(turn_rewards, mode: str, discount: float) -> float:
    """The environment's part of a trajectory's reward: its per-turn rewards summed
    ("sum") or weighed `discount ** t` for turn t = 0, 1, ... ("discount")."""
    r = np.asarray(list(turn_rewards), np.float64)
    if mode == "sum":
        return float(r.sum())
    if mode == "discount":
        return float((r * discount ** np.arange(r.size)).sum())
    raise ValueError(f"rollout.turn_reward={mode!r}; choose sum or discount")


def driver_rows(prompts, reward=None) -> list[dict]:
    """The rows an environment starts from, one per prompt: the prompt's metadata (a tool
    task's table: `lrl.data.synthetic.tool_lookup`) with its answer and text, and the final
    answer's reward spec (`reward`: the run's terms) for environments that score one."""
    extra = {} if reward is None else {"reward": reward}
    return [{**dict(p.meta), "answer": str(p.answer), "prompt": p.text, **extra}
            for p in prompts]


def make_driver(s, prompts, group_size: int):
    """The environment driver of one rollout of `prompts` under the run's options: steps
    run in the run's reward pool, the final answer scored by its terms (no pool: steps in
    this process, and the environment's own reward)."""
    from lrl.envs.driver import Driver
    ro = s.rollout
    terms = None if s.pool is None else [(t.name, t.weight, dict(t.kwargs))
                                         for t in s.pool.terms] or None
    # With a reward model the rule terms' pool, or the one kept for the steps (`workers`).
    pool = getattr(s.pool, "workers", s.pool)
    return Driver(ro.env, driver_rows(prompts, terms), s.tokenizer, max_turns=ro.max_turns,
                  pool=pool, timeout_s=ro.tool_timeout_s, group_size=group_size,
                  discount=ro.turn_discount if ro.turn_reward == "discount" else 1.0)


def rollout_groups(s, params, prompts: list, *, group_size: int, seed: int,
                   temperature: Optional[float] = None, stats: Optional[dict] = None,
                   driver_fn: Optional[Callable] = None):
    """G trajectories of every prompt -> unscored `Groups` with `masks` and `trajectories`
    (each sample's turns, tool calls, errors, timeouts, tool seconds, end and environment
    reward); `stats` gains the scheduler's and the driver's numbers. `driver_fn(s, prompts,
    group_size)` builds the driver (default `make_driver`)."""
    from lrl import collect
    driver = (driver_fn or make_driver)(s, prompts, group_size)
    try:
        res = collect.run_rollout(s, params, [p.ids for p in prompts], group_size=group_size,
                               seed=seed, temperature=temperature, stats=stats, turns=driver,
                               max_turn_tokens=s.rollout.max_turn_tokens)
        trajs = driver.results()
        env_metrics = driver.metrics()
    finally:
        driver.close()
    return groups_of(s, prompts, group_size, res, trajs, env_metrics, stats)


def groups_of(s, prompts: list, G: int, res, trajs: dict, env_metrics: dict,
              stats: Optional[dict]):
    """`rollout_groups`' Groups from the scheduler's `Result` and the driver's trajectories."""
    from lrl.groups import Groups
    completions, logps, masks, records, truncated = [], [], [], [], []
    ro = s.rollout
    for p, per in enumerate(res.samples):
        if len(per) != G:
            raise ValueError(f"multi-turn rollout: prompt {p} came back with {len(per)} "
                             f"samples, expected {G}")
        for g, (ids, lp) in enumerate(per):
            ids = np.asarray(ids, np.int32)
            mask = (np.ones(ids.size, np.int8) if res.model_masks is None
                    else np.asarray(res.model_masks[p][g], np.int8))
            if mask.shape != ids.shape:
                raise ValueError(f"multi-turn rollout: sample {(p, g)} has {ids.size} tokens "
                                 f"but a model mask of {mask.size}")
            end = res.ends[p][g] if res.ends is not None else "stop"
            rec = record(ro, trajs.get((p, g)), end, mask)
            completions.append(ids)
            logps.append(np.asarray(lp, np.float32))
            masks.append(mask)
            records.append(rec)
            truncated.append(rec["end"] == "length")
    if stats is not None:   # "env/x" -> rollout/env_x among the rollout's metrics
        stats.update({k.replace("/", "_"): v for k, v in env_metrics.items()
                      if np.isscalar(v)})
    return Groups(tuple(prompts), tuple(completions), tuple(logps), G,
                  np.asarray(truncated, bool), masks=tuple(masks), trajectories=tuple(records))


def record(ro, t, end: str, mask: np.ndarray) -> dict:
    """A trajectory's entry of `Groups.trajectories`: `t` the driver's `Trajectory` (None: it
    never ended a turn), `end` the scheduler's end of the sample, `mask` its model mask."""
    rec = {"end": end if t is None else (t.end if end != "length" else "length"),
           "env_reward": 0.0 if t is None else trajectory_reward(
               t.turn_rewards, ro.turn_reward, ro.turn_discount),
           "model_tokens": int(mask.sum()), "observed_tokens": int(mask.size - mask.sum()),
           # each observation's messages, for a reward model's rendering (`conversation`)
           "observations": [] if t is None else list(getattr(t, "observations", ()))}
    for k in COUNTS:
        rec[k] = 0 if t is None else getattr(t, k)
    return rec


def metrics(groups) -> dict:
    """The step's trajectory metrics: turns per trajectory, tool calls and their errors and
    timeouts, tool wall time, tokens generated versus observed, how trajectories ended."""
    recs = groups.trajectories
    if not recs:
        return {}
    n = len(recs)
    out = {f"turns/{k}_mean": float(np.mean([r[k] for r in recs])) for k in COUNTS}
    out["turns/turns_max"] = float(max(r["turns"] for r in recs))
    out["turns/tool_s_total"] = float(sum(r["tool_s"] for r in recs))
    gen = sum(r["model_tokens"] for r in recs)
    obs = sum(r["observed_tokens"] for r in recs)
    out.update({"turns/generated_tokens": gen, "turns/observed_tokens": obs,
                "turns/observed_frac": obs / max(gen + obs, 1),
                "turns/env_reward_mean": float(np.mean([r["env_reward"] for r in recs]))})
    for end in sorted({r["end"] for r in recs}):
        out[f"turns/end_{end}_frac"] = sum(r["end"] == end for r in recs) / n
    return out


def _runs(completion, mask):
    """A trajectory's tokens as its runs: (ids, whether the model wrote them), in order."""
    completion, mask = np.asarray(completion), np.asarray(mask) > 0
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    return [(ids, bool(m[0])) for ids, m in zip(np.split(completion, cuts), np.split(mask, cuts))
            if ids.size]


def trajectory_text(tokenizer, completion, mask) -> str:
    """A trajectory as text (special tokens kept), each run of observation tokens (mask 0)
    wrapped in [observation]...[/observation]: what samples.jsonl shows, the model's turns
    and what the environment answered."""
    out = []
    for ids, model in _runs(completion, mask):
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        out.append(text if model else f"[observation]{text}[/observation]")
    return "".join(out)


def conversation(tokenizer, completion, mask, observations) -> list[dict]:
    """A trajectory's turns as chat messages, for a reward model to render in its own
    template (`lrl.rewards.model.score`): each run of model tokens (mask 1) an assistant
    message of its text as the environment read it (special tokens dropped), each run of
    observation tokens the messages the environment returned (`observations`, one list a
    run; a run without one, its decoded text as a tool message)."""
    out, k = [], 0
    for ids, model in _runs(completion, mask):
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        if model:
            out.append({"role": "assistant", "content": text})
        else:
            out.extend(observations[k] if k < len(observations)
                       else [{"role": "tool", "content": text}])
            k += 1
    return out
