"""The scheduler's host state (`lrl.rollout.scheduler`): one rollout's slots, what waits, what
runs, its counts and clocks (`Rollout`), built by `start` and read by `report`.

P prompts · G samples per prompt · B batch rows: the engine's slots.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Callable, NamedTuple, Optional

import jax
import numpy as np

from lrl.rollout.engine import DecodeState, Engine, StepOutput
from lrl.rollout.pages import pages_for
from lrl.rollout.request import Policy, Request, check_prompts


class Phase(enum.Enum):
    """A sample's phase. FREE: no sample. LIVE: its sample decodes in the calls launched
    from its admission on, until the collection that sees it end. WAITING: a multi-turn
    sample between turns (`lrl.rollout.turns`): its record leaves the decode rows for
    `Rollout.paused`, its pages held (a `Kept` handle) unless memory ran short."""
    FREE = 0
    LIVE = 1
    WAITING = 2


@dataclasses.dataclass
class Slot:
    """One decode row as the host knows it."""
    sample: Optional[tuple[int, int]] = None   # (p, g) it holds; None: free
    phase: Phase = Phase.FREE
    limit: int = 0         # tokens its sample samples at most
    cached: int = 0        # cache positions it has filled, as collected
    rope_delta: int = 0
    since: int = 0         # the first decode call its sample is in (calls numbered from 0)
    tokens: list = dataclasses.field(default_factory=list)   # sampled: one array a call
    logps: list = dataclasses.field(default_factory=list)
    # multi-turn (`lrl.rollout.turns`): observations are chunks of `tokens` too (log-prob 0)
    spans: list = dataclasses.field(default_factory=list)   # (start, length) of each one
    observed: int = 0      # their tokens
    turn: int = 0          # model turns ended so far
    turn_start: int = 0    # tokens before the current model turn
    turn_cap: int = 0      # tokens the current turn may sample (0: no cap)
    kept: object = None    # WAITING: its pages (`Kept`), None once released
    pending: object = None   # an observation to append when it resumes
    paused_at: float = 0.0
    # `sampled`'s running count over the first `_seen` chunks: the scheduler asks it of every
    # queued and live sample each round, and a long sample has a chunk per decode call
    _seen: int = dataclasses.field(default=0, repr=False, compare=False)
    _count: int = dataclasses.field(default=0, repr=False, compare=False)

    @property
    def sampled(self) -> int:
        """Tokens after the prompt (observations included)."""
        n = len(self.tokens)
        if n < self._seen:   # the list was replaced: count anew
            self._seen = self._count = 0
        while self._seen < n:
            self._count += len(self.tokens[self._seen])
            self._seen += 1
        return self._count

    def history(self):
        """All its tokens after the prompt, int32."""
        return np.concatenate(self.tokens or [np.zeros(0)]).astype(np.int32)


class Call(NamedTuple):
    """A launched decode call: its output [steps, B], the rows it computed, its number."""
    out: StepOutput
    width: int
    number: int


@dataclasses.dataclass
class Rollout:
    """One rollout's host state. What waits: `queue` (prompts with samples not yet admitted,
    `next_sample[p]` the next), `redo` (preempted samples) and `resume` (kept samples, by
    prompt); what runs: `slots`, `admitted` (the held slots, oldest first: the youngest is
    preempted first) and `free`; `device` is the engine's decode state, threaded through
    every device step."""
    engine: Engine
    request: Request
    policy: Policy
    prompts: list                 # [P] int32 token ids
    counts: list                  # [P] samples of each prompt
    max_new: list                 # [P] tokens each of its samples samples at most
    first_id: list                # [P] the sample id of its first sample
    device: DecodeState
    rng: jax.Array
    params: object                # the trainer's layout (for `prefill_fn`)
    dparams: object               # the decode layout
    prefill_fn: Optional[Callable]
    timed: bool                   # stats asked for: block on a prefill to time it
    slots: list
    free: collections.deque
    queue: collections.deque
    redo: collections.deque = dataclasses.field(default_factory=collections.deque)
    admitted: list = dataclasses.field(default_factory=list)
    resume: dict = dataclasses.field(default_factory=dict)
    # multi-turn: samples waiting on their environment ((p, g) -> Slot, in pause order) and
    # those whose observation (or a preemption) sends them back in, admitted first
    paused: dict = dataclasses.field(default_factory=dict)
    turn_queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    masks: list = None            # [P][G] model masks of finished samples
    ends: list = None             # [P][G] why each ended
    open_prefix: dict = dataclasses.field(default_factory=dict)   # p -> Prefix taking samples
    limits: dict = dataclasses.field(default_factory=dict)   # sample id -> its limit, asked once
    next_sample: list = None
    results: list = None
    launched: int = 0             # decode calls launched so far
    in_flight: Optional[Call] = None   # launched, not yet collected
    finished_now: list = dataclasses.field(default_factory=list)   # since stop_fn was asked
    stopped: bool = False
    st: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    prefilled: list = dataclasses.field(default_factory=list)     # prompts, once a prefix
    # decode_s: the wall time from the first decode call's launch to the last collection,
    # less the prefills timed alone in it; so it holds the host's work between calls too.
    t_prefill: float = 0.0
    t_prefill_decoding: float = 0.0
    t_decode0: Optional[float] = None

    @property
    def grow(self) -> bool:
        """Pages grow with the samples (a call's worth ahead) unless `reserve_pages`."""
        return not self.policy.reserve_pages

    @property
    def multi(self) -> bool:
        return self.request.turns is not None

    def waiting(self) -> bool:
        """Whether a sample waits for a slot (not one waiting on its environment)."""
        return bool(self.queue or self.redo or self.turn_queue)


def start(engine: Engine, params, request: Request, policy: Policy, decode_params,
          prefill_fn, timed: bool) -> Rollout:
    """The state before the first admission: every sample waiting, every slot free, the
    kept samples to resume checked against their prompts."""
    prompts = check_prompts(request.prompts, engine.cfg.vocab_size)
    counts, max_new = request.counts, request.max_new
    for i, p in enumerate(prompts):
        engine.check_fits(len(p), max_new[i], what=f"prompt {i}")
    resume = {}
    for p, k in enumerate(request.kept or ()):
        if k is None or not engine.holds(k):
            engine.release_kept([k])   # another engine's: prefilled here
            continue
        if counts[p] != 1 or k.length != len(prompts[p]) - 1 or k.token != prompts[p][-1]:
            raise ValueError(f"generate: prompt {p} ({len(prompts[p])} tokens, "
                             f"{counts[p]} samples) is not its kept sample's ({k.length} "
                             f"tokens cached, next token {k.token})")
        resume[p] = k
    device = engine.take_state()
    B = engine.ecfg.max_slots
    return Rollout(
        engine=engine, request=request, policy=policy, prompts=prompts, counts=counts,
        max_new=max_new, first_id=request.first_ids(), device=device,
        rng=jax.random.key(request.seed), params=params,
        dparams=engine.decode_params(params) if decode_params is None else decode_params,
        prefill_fn=prefill_fn, timed=timed, slots=[Slot() for _ in range(B)],
        free=collections.deque(range(B)), queue=collections.deque(range(len(prompts))),
        resume=resume, next_sample=[0] * len(prompts), results=[[None] * n for n in counts],
        masks=[[None] * n for n in counts], ends=[[None] * n for n in counts])


def report(r: Rollout, t_decode: float) -> dict:
    """The rollout's stats: counts (decode_steps, new_tokens, sampled_tokens (preempted ones
    included), kv_token_steps, preempted, ...), timings (prefill_s: prefills timed alone;
    decode_s: from the first decode call to the last collection, less those) and shares;
    multi-turn rollouts add turns, observed_tokens, wait_s (sample-seconds waiting on
    environments), blocked_s (the scheduler waiting on them with nothing to decode),
    extend_calls (the observations' prefill calls), refilled and waiting_released (the
    memory rule's re-prefills) and occupancy_waiting."""
    e, st, B = r.engine, r.st, r.engine.ecfg.max_slots
    ps = e.ecfg.page_size
    steps = max(1, st["decode_steps"] * B)
    multi = {} if not r.multi else dict(
        turns=st["turns"], observed_tokens=st["observed_tokens"], wait_s=st["wait_s"],
        blocked_s=st["blocked_s"], refilled=st["refilled"], extend_calls=st["extend_calls"],
        waiting_released=st["waiting_released"],
        # the slot occupancy over the decode steps while some sample waited on its
        # environment (a ratio: over many rounds, from the two counts)
        steps_while_waiting=st["steps_while_waiting"],
        sampled_while_waiting=st["sampled_while_waiting"],
        occupancy_waiting=st["sampled_while_waiting"] / max(1, st["steps_while_waiting"] * B))
    return dict(
        st, prefill_s=r.t_prefill, decode_s=t_decode, prefilled=r.prefilled,
        num_pages=e.ecfg.num_pages, slots=B,
        # the share of decode-step rows that sampled a token
        occupancy=st["new_tokens"] / steps,
        # the share of decode-step rows live, what preemption then threw away included: the
        # slot occupancy over the rollout
        slot_occupancy=st["sampled_tokens"] / steps,
        # the share of the rows the decode steps computed that sampled a token (narrow tail
        # calls compute fewer rows than the slots)
        row_occupancy=st["sampled_tokens"] / max(1, st["computed_rows"]),
        attention_impl=e.ecfg.attention_impl, attention_fallback=e.fallback,
        sampling_impl=e.ecfg.sampling_impl, pages_allocated=e.pool.allocated_total,
        pages_unshared=sum(n * pages_for(len(p) + m - 1, ps)
                           for p, n, m in zip(r.prompts, r.counts, r.max_new)),
        prefill_tokens_unshared=sum(n * (len(p) - 1) for p, n in zip(r.prompts, r.counts)),
        **multi)


def done(r: Rollout, slot: Slot, end: str, finished: bool = True) -> None:
    """Slot's sample ends (`end`: "stop", "done", "length" or "cut"): its tokens, log-probs
    and model mask become its result; `finished`: the stop rule hears of it."""
    p, g = slot.sample
    tokens = slot.history()
    mask = np.ones(tokens.size, np.int8)
    for at, n in slot.spans:
        mask[at:at + n] = 0
    r.results[p][g] = (tokens, np.concatenate(slot.logps or [np.zeros(0)]).astype(np.float32))
    r.masks[p][g], r.ends[p][g] = mask, end
    r.st["new_tokens"] += tokens.size - slot.observed
    if finished:
        r.finished_now.append((p, g))
