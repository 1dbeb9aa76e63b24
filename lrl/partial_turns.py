"""Partial rollouts of multi-turn trajectories (`rollout.partial` with `rollout.env`): the
multi-turn round of `lrl.collect_partial` (`decode_round`) and its complete groups.

A trajectory the partial stop cuts short is carried to the next step like any partial sample
(`lrl.rollout.partial.Sample`: its tokens so far, observations included, each token's
log-prob and policy version), plus what multi-turn adds: its model mask (`Sample.mask`) and
its turn state (`Sample.turn`, a `TurnState`: the environment as its last step left it, the
trajectory's counts and per-turn rewards, where its current model turn starts). The next
round's driver takes it back (`Driver.resume`), so its current turn goes on from its last
token, the turn's text and `max_turns` counted across the cut.

Cut while waiting on its environment: the step already running is waited for at the cut
(`Driver.drain`; at most `rollout.tool_timeout_s`), so the carried sample holds the
observation (mask 0) and resumes decoding after it; or the environment ended the trajectory,
and the sample is done. Nothing of a step is lost or run twice.

Not carried: KV pages (a carried trajectory is prefilled again: `rollout.partial_keep_kv` is
off with `rollout.env`), and a per-turn cap (`rollout.max_turn_tokens`) restarts for the turn
a cut split.

    decode_round: partial.requests -> make_driver + Driver.resume per carried trajectory
                  -> collect.run_rollout(turns=driver, stop_fn) -> Driver.drain -> advance

P prompts · G samples per prompt.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from lrl import collect, trajectories
from lrl.groups import Groups
from lrl.rollout import partial


@dataclasses.dataclass(frozen=True)
class TurnState:
    """A carried trajectory's turn state: `live` the driver's record of it (`Driver.state`:
    environment, `Trajectory`, turn start; None before its first turn ended) and `end`, once
    done, the scheduler's end of the sample ("stop", "done", "length")."""
    live: Optional[object] = None
    end: str = ""


def decode_round(s, params, pending: tuple, step: int, target: int, *, tokens: int,
                 seconds: float, seed: int, stats: dict) -> tuple[tuple, int]:
    """`lrl.collect_partial._decode_round` for trajectories: one multi-turn rollout of the
    unfinished samples of `pending` under `params` (policy version `step`), stopped by
    `partial.stop_rule` or in the tail. -> (pending after it, the carried tokens prefilled
    again)."""
    ro, G = s.rollout, s.rl.group_size
    ids, counts, max_new, index = partial.requests(pending, s.rl.max_new_tokens)
    driver = trajectories.make_driver(s, [pending[per[0][0]].prompt for per in index], 0)
    try:
        for r, per in enumerate(index):
            x = pending[per[0][0]].samples[per[0][1]]
            if x.tokens.size:
                driver.resume((r, 0), x.turn.live if x.turn else None, x.tokens)
        res = collect.run_rollout(
            s, params, ids, group_size=G, seed=seed, stats=stats,
            samples=[(pending[i].prompt.ids, j, pending[i].samples[j].tokens.size)
                     for per in index for i, j in per],
            samples_per_prompt=counts, max_new_per_prompt=max_new,
            stop_fn=partial.stop_rule(pending, index, target, tokens, seconds),
            stop_below=math.ceil(ro.partial_tail * ro.max_slots), turns=driver,
            max_turn_tokens=ro.max_turn_tokens)
        answers = dict(driver.drain())
        states = {(r, g): driver.state((r, g)) for r, per in enumerate(index)
                  for g in range(len(per))}
        env = driver.metrics()
    finally:
        driver.close()
    stats.update({k.replace("/", "_"): v for k, v in env.items()
                  if np.isscalar(v) and not k.endswith("_mean")})
    reprefill = sum(len(ids[r]) - len(pending[index[r][0][0]].prompt.ids)
                    for r in stats.get("prefilled", ()))
    return advance(s, pending, index, res, answers, states, step), reprefill


def advance(s, pending: tuple, index: list, res, answers: dict, states: dict,
            version: int) -> tuple:
    """`pending` after one multi-turn rollout: each sample's tokens, log-probs and model mask
    appended (drawn by policy `version`), then a drained step's observation (`answers`), with
    its turn state (`states`)."""
    samples = [list(g.samples) for g in pending]
    cut = set(map(tuple, res.unfinished))
    for r, per in enumerate(res.samples):
        for g, (toks, logps) in enumerate(per):
            i, j = index[r][g]
            live, x = states.get((r, g)), samples[i][j]
            end = res.ends[r][g] if res.ends is not None else "stop"
            x = x.extend(toks, logps, version, (r, g) not in cut, mask=res.model_masks[r][g],
                         turn=TurnState(live, "" if (r, g) in cut else end))
            if (r, g) in answers:
                x = _answered(s, x, answers[(r, g)], version)
            samples[i][j] = x
    return tuple(partial.Pending(grp.prompt, tuple(x)) for grp, x in zip(pending, samples))


def _answered(s, x: partial.Sample, obs, version: int) -> partial.Sample:
    """Sample `x`, cut waiting on its environment, after the step's answer: the observation
    appended (it ends by length if that leaves no room), or None: the trajectory ended."""
    if obs is None:
        return dataclasses.replace(x, done=True, turn=TurnState(x.turn.live, "done"))
    x = x.extend(obs, np.zeros(len(obs), np.float32), version, False,
                 mask=np.zeros(len(obs), np.int8), turn=x.turn)
    if x.tokens.size >= s.rl.max_new_tokens:
        return dataclasses.replace(x, done=True, turn=TurnState(x.turn.live, "length"))
    return x


def complete_groups(s, done: tuple, step: int) -> Groups:
    """Complete `Pending` groups of trajectories as Groups (masks, trajectory records, each
    sample's age counted from its oldest token), unscored."""
    samples = [x for g in done for x in g.samples]
    recs = [trajectories.record(s.rollout, getattr(x.turn.live, "traj", None), x.turn.end,
                                x.mask) for x in samples]
    return Groups(tuple(g.prompt for g in done), tuple(x.tokens for x in samples),
                  tuple(x.logps for x in samples), s.rl.group_size,
                  np.array([r["end"] == "length" for r in recs], bool),
                  masks=tuple(x.mask for x in samples), trajectories=tuple(recs),
                  ages=np.array([step - x.oldest() for x in samples], np.int32))
