"""The driver of multi-turn rollouts: environment steps for the scheduler's model turns.

`Driver` implements the scheduler's `Turns` protocol (MULTITURN.md, `lrl.rollout.request`):
`turn_ended(key, tokens, room, cut)` starts the sample's environment step without waiting
(in a reward worker process: `RewardPool.submit`), `ready(block)` hands back finished steps
as the observation's token ids to append, or None when the trajectory ended. Afterwards
`results()` gives each trajectory's rewards, counts and end, and `metrics()` the step's sums.

Ends of a trajectory (`Trajectory.end`):
  done       the environment said so
  max_turns  `max_turns` model turns were taken and the environment had not ended
  room       the observation's ids do not fit the tokens the sample may still add; the
             trajectory ends without it (on_room="end", the default: a cut observation would
             show the model half a tool result and leave it no room to answer), or with it
             cut to the room (on_room="truncate"; the sample then ends by length)
  cut        the model turn reached the scheduler's per-turn cap (no step is run)
  timeout    the step overran `timeout_s`: its worker is killed and replaced
  error      the step raised, returned something that is not a `Step`, or its observation
             could not be rendered; the message is in `Trajectory.error`
  length     the scheduler ended the sample at its token limit (no turn_ended for it)
Timeouts and errors end one trajectory and are counted; they never stop the rollout.

Every sample (p, g) starts from its own copy of the environment as `reset(rows[p])` left it.
The environment travels to the worker and back with every step (steps are stateless for the
pool, so a killed worker loses nothing but the step it ran). `pool=None` runs steps in this
process, at once, without a time limit (tests, debugging).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Optional, Union

import numpy as np

from lrl.envs.base import Environment, Factory, Step, make
from lrl.envs.render import observation_ids

Key = tuple[int, int]
ENDS = ("done", "max_turns", "room", "cut", "timeout", "error", "length")
ON_ROOM = ("end", "truncate")


@dataclasses.dataclass
class Trajectory:
    reward: float = 0.0            # Σ_t discount^t · turn_rewards[t]
    turn_rewards: list = dataclasses.field(default_factory=list)
    turns: int = 0                 # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    timeouts: int = 0
    tool_s: float = 0.0            # wall time of its environment steps (in the worker)
    end: str = "length"
    observed_tokens: int = 0       # observation ids appended
    error: str = ""                # why it ended in "error" or "timeout"
    observations: list = dataclasses.field(default_factory=list)   # their messages, a list each

    def __setstate__(self, state: dict) -> None:
        # A checkpoint's carried trajectory pickled before `observations` was kept.
        self.__dict__.update({"observations": [], **state})


def _run_step(env: Environment, text: str, tokens: np.ndarray):
    """The worker's job: one environment step; -> (the environment after it, Step, seconds)."""
    t0 = time.perf_counter()
    out = env.step(text, tokens)
    return env, out, time.perf_counter() - t0


def _check_step(step) -> Optional[str]:
    """None if `step` is a Step the driver can read, else what is wrong with it."""
    if not isinstance(step, Step):
        return f"step returned a {type(step).__name__}, not a Step"
    try:
        reward = float(step.reward)
        counts = [int(step.info.get(k, 0)) for k in ("tool_calls", "tool_errors")]
    except (TypeError, ValueError, AttributeError) as e:
        return f"step returned an unreadable reward or info: {type(e).__name__}: {e}"
    if not math.isfinite(reward) or min(counts) < 0:
        return f"step returned reward {step.reward} and counts {counts}"
    return None


@dataclasses.dataclass
class _Live:
    env: Environment
    traj: Trajectory
    start: int = 0           # where the current model turn starts in the sample's tokens
    length: int = 0          # len(tokens) when the turn ended
    room: int = 0
    last_token: Optional[int] = None
    ticket: Optional[int] = None


class Driver:
    """Runs environment steps for a rollout's samples (see the module docstring).

    Args:
      env: an environment name, "pkg.module:Factory" or a factory; `env_kwargs` go to it.
      rows: the dataset rows, one per prompt p.
      tokenizer: the policy's (`decode`, `encode`, `apply_chat_template`).
      template: a chat template overriding the tokenizer's.
      max_turns: model turns per trajectory.
      pool: a `lrl.rewards.RewardPool` to run steps in, or None (in this process).
      timeout_s: limit of one step (with a pool).
      on_room: "end" or "truncate" (see "room" above).
      discount: per-turn discount of the trajectory's reward (1: the sum).
      end_ids: the model's end-of-turn ids (default: the tokenizer's eos).
      group_size: with it, `results()` covers every (p, g), g < group_size, also samples
        that never ended a turn.
    """

    def __init__(self, env: Union[str, Factory], rows: Sequence[Mapping], tokenizer, *,
                 template: Optional[str] = None, max_turns: int = 8, pool=None,
                 timeout_s: Optional[float] = 30.0, on_room: str = "end",
                 discount: float = 1.0, end_ids: Sequence[int] = (), group_size: int = 0,
                 env_kwargs: Optional[Mapping] = None):
        if max_turns < 1:
            raise ValueError(f"Driver: max_turns must be >= 1, got {max_turns}")
        if on_room not in ON_ROOM:
            raise ValueError(f"Driver: on_room must be one of {ON_ROOM}, got {on_room!r}")
        if pool is not None and not all(hasattr(pool, a) for a in ("submit", "poll", "cancel")):
            raise TypeError(f"Driver: pool must be a lrl.rewards.RewardPool (submit / poll / "
                            f"cancel), got {type(pool).__name__}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"Driver: discount must be in (0, 1], got {discount}")
        self.tokenizer, self.template, self.pool = tokenizer, template, pool
        self.max_turns, self.timeout_s, self.on_room = max_turns, timeout_s, on_room
        self.discount, self.group_size = discount, group_size
        eos = getattr(tokenizer, "eos_token_id", None)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.end_ids = tuple(dict.fromkeys([*end_ids, *eos]))
        self._start_envs, self._first = [], []
        for p, row in enumerate(rows):
            e = make(env, **dict(env_kwargs or {}))
            try:
                self._first.append(e.reset(row))
            except Exception as err:
                raise ValueError(f"Driver: environment {env!r} failed to reset on row {p}: "
                                 f"{type(err).__name__}: {err}") from err
            self._start_envs.append(e)
        self._live: dict[Key, _Live] = {}
        self._tickets: dict[int, Key] = {}
        self._finished: list[tuple[Key, str, object]] = []   # in-process steps and cut turns
        self._prefix: dict[Key, np.ndarray] = {}   # carried trajectories' tokens (`resume`)
        self._restarts0 = getattr(pool, "n_restarts", 0)

    def first_observation(self, p: int) -> Optional[str]:
        """What `reset(rows[p])` returned: text for the data side to end the prompt with."""
        return self._first[p]

    # ----- the Turns protocol -------------------------------------------------------------

    def turn_ended(self, key: Key, tokens, room: int, cut: bool) -> None:
        p, _ = key
        if not 0 <= p < len(self._start_envs):
            raise KeyError(f"Driver: sample {key} is for prompt {p}, but there are "
                           f"{len(self._start_envs)} rows")
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = _Live(copy.deepcopy(self._start_envs[p]), Trajectory())
        if live.traj.end != "length" or live.ticket is not None:
            state = live.traj.end if live.ticket is None else "a step still running"
            raise RuntimeError(f"Driver: turn_ended for sample {key}, which has {state}")
        tokens = np.asarray(tokens, np.int32)
        if key in self._prefix:
            tokens = np.concatenate([self._prefix[key], tokens])
        turn = tokens[live.start:]
        live.traj.turns += 1
        live.length, live.room = len(tokens), int(room)
        live.last_token = int(tokens[-1]) if len(tokens) else None
        if cut:
            self._finished.append((key, "cut", None))
            live.ticket = -1
            return
        text = self.tokenizer.decode(turn.tolist(), skip_special_tokens=True)
        if self.pool is None:
            try:
                self._finished.append((key, "ok", _run_step(live.env, text, turn)))
            except Exception as e:  # noqa: BLE001 - the trajectory ends in "error", counted
                self._finished.append((key, "error", f"{type(e).__name__}: {e}"))
            live.ticket = -1
        else:
            live.ticket = self.pool.submit(_run_step, live.env, text, turn,
                                           timeout_s=self.timeout_s)
            self._tickets[live.ticket] = key

    def ready(self, block: bool) -> list[tuple[Key, Optional[np.ndarray]]]:
        out = [self._on_step(*f) for f in self._finished]
        self._finished = []
        if self.pool is not None and self._tickets:
            wait = None if block and not out else 0.0
            for ticket, status, payload in self.pool.poll(wait, list(self._tickets)):
                out.append(self._on_step(self._tickets.pop(ticket), status, payload))
        if block and not out:
            raise RuntimeError("Driver.ready(block=True): no environment step is running, "
                               "so nothing will ever be ready")
        return out

    # ----- partial rollouts: trajectories carried across rollouts -----------------------

    def resume(self, key: Key, state: Optional[_Live], tokens) -> None:
        """Sample `key` goes on with a trajectory an earlier rollout cut short: `state` is
        what `state(key)` gave there (None: it had not ended a turn), `tokens` its tokens so
        far, which this rollout holds as part of its prompt (`turn_ended`'s come after)."""
        self._prefix[key] = np.asarray(tokens, np.int32)
        if state is not None:
            self._live[key] = copy.deepcopy(state)

    def state(self, key: Key) -> Optional[_Live]:
        """Sample `key`'s trajectory (environment, counts, where its turn starts), or None."""
        return self._live.get(key)

    def drain(self) -> list[tuple[Key, Optional[np.ndarray]]]:
        """After a rollout a stop cut short: waits for the steps still running (of samples
        cut while waiting on their environment) -> their answers, as `ready` gives them."""
        out = []
        while self._finished or self._tickets:
            out += self.ready(block=True)
        return out

    # ----- a finished step ----------------------------------------------------------------

    def _end(self, live: _Live, end: str, error: str = "") -> None:
        live.traj.end, live.traj.error = end, error

    def _on_step(self, key: Key, status: str, payload) -> tuple[Key, Optional[np.ndarray]]:
        live = self._live[key]
        live.ticket = None
        traj = live.traj
        if status != "ok":
            traj.timeouts += status == "timeout"
            self._end(live, status, "" if payload is None else str(payload))
            return key, None
        live.env, step, seconds = payload
        traj.tool_s += seconds
        problem = _check_step(step)
        if problem is not None:
            self._end(live, "error", problem)
            return key, None
        traj.turn_rewards.append(float(step.reward))
        traj.reward = sum(r * self.discount ** t for t, r in enumerate(traj.turn_rewards))
        traj.tool_calls += int(step.info.get("tool_calls", 0))
        traj.tool_errors += int(step.info.get("tool_errors", 0))
        if step.done:
            self._end(live, "done")
            return key, None
        if traj.turns >= self.max_turns:
            self._end(live, "max_turns")
            return key, None
        try:
            ids, messages = self._render(live, step)
        except Exception as e:  # noqa: BLE001 - a bad observation ends this trajectory only
            self._end(live, "error", f"cannot render the observation: {type(e).__name__}: {e}")
            return key, None
        if len(ids) > live.room:
            if self.on_room == "end" or live.room < 1:
                self._end(live, "room", f"observation of {len(ids)} tokens, room {live.room}")
                return key, None
            ids = ids[:live.room]
        live.start = live.length + len(ids)
        traj.observed_tokens += len(ids)
        traj.observations.append(messages)
        return key, np.asarray(ids, np.int32)

    def _render(self, live: _Live, step: Step) -> tuple[list[int], list[dict]]:
        obs = step.observation
        texts = [""] if obs is None else [obs] if isinstance(obs, str) else list(obs)
        role = step.info.get("role", live.env.role)
        messages = [{"role": role, "content": t} for t in texts]
        return observation_ids(self.tokenizer, messages, last_token=live.last_token,
                               end_ids=self.end_ids, chat_template=self.template), messages

    # ----- after the rollout --------------------------------------------------------------

    def results(self) -> dict[Key, Trajectory]:
        """Every trajectory seen (and, with group_size, every (p, g)); one still live when
        the rollout returned ended by length."""
        out = {k: v.traj for k, v in self._live.items()}
        for p in range(len(self._start_envs) if self.group_size else 0):
            for g in range(self.group_size):
                out.setdefault((p, g), Trajectory())
        return dict(sorted(out.items()))

    def metrics(self) -> dict[str, float]:
        """Sums and means over the trajectories, as "env/..." metrics."""
        trajs = list(self.results().values())
        n = max(len(trajs), 1)
        m = {
            "env/trajectories": float(len(trajs)),
            "env/turns_mean": sum(t.turns for t in trajs) / n,
            "env/tool_calls": float(sum(t.tool_calls for t in trajs)),
            "env/tool_errors": float(sum(t.tool_errors for t in trajs)),
            "env/timeouts": float(sum(t.timeouts for t in trajs)),
            "env/errors": float(sum(t.end == "error" for t in trajs)),
            "env/tool_s": float(sum(t.tool_s for t in trajs)),
            "env/observed_tokens": float(sum(t.observed_tokens for t in trajs)),
            "env/reward_mean": sum(t.reward for t in trajs) / n,
            "env/worker_restarts": float(getattr(self.pool, "n_restarts", 0) - self._restarts0),
        }
        for end in ENDS:
            m[f"env/end_{end}"] = float(sum(t.end == end for t in trajs))
        return m

    def close(self) -> None:
        """Cancels the steps still running (their workers are replaced if busy)."""
        if self.pool is not None:
            for ticket in list(self._tickets):
                self.pool.cancel(ticket)
        for ticket, key in self._tickets.items():
            self._live[key].ticket = None
        self._tickets.clear()
        self._finished = []

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
