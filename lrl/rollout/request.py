"""What a rollout samples (`Request`), how the scheduler runs it (`Policy`) and what comes back
(`Result`): the scheduler's (`lrl.rollout.scheduler`) three records.

    request = Request(prompts, max_new_tokens=256, num_samples=8, seed=0)
    result = scheduler.run(engine, params, request)
    tokens, logps = result.samples[p][g]

A prompt's samples have ids that run on over the prompts in order (sample g of prompt p is
`first_id[p] + g`, `p * G + g` when every prompt has G); a sample draws its tokens with keys
derived from (seed, its id, step), whatever slot it lands in, so a preempted sample that runs
again draws the same tokens.

Partial rollouts (`lrl.rollout.partial`) fill the rest: `samples_per_prompt` and
`max_new_per_prompt` let a carried sample come back as a prompt of its own (its prompt and
tokens so far, one sample, the tokens it has left); `stop_fn` / `stop_below` stop the rollout
early, and the samples it cut short are `Result.unfinished`; `kept` resumes samples from KV
pages an earlier rollout left in the engine's pool, and `keep_kv` leaves this rollout's
stopped samples' pages there (`Result.kept`).

Multi-turn rollouts (`turns`, a `Turns`: `lrl.envs.driver.Driver`) alternate model turns and
observations in one sample: when a model turn ends the sample waits, its KV pages held, while
its environment step runs; the observation's tokens are then prefilled after its pages and it
decodes on (`lrl.rollout.turns`). `samples[p][g]` holds the whole trajectory after the prompt,
`model_masks[p][g]` which of its tokens the model sampled.

P prompts · G samples per prompt · T prompt tokens · D model width.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from lrl.rollout.sampling import SamplingParams

# Decode steps a call runs (fewer once no slot is live): a finished slot waits for the call's
# end to be refilled, and each call costs the host a collection.
STEPS_PER_CALL = 16


class Turns(Protocol):
    """The environment side of a multi-turn rollout (`lrl.envs.driver.Driver`), asked by the
    scheduler from its own thread."""

    def turn_ended(self, key: tuple[int, int], tokens: np.ndarray, room: int,
                   cut: bool) -> None:
        """Sample key=(p, g)'s model turn ended (an end token in `Request.eos_ids` or in
        `Request.turn_end_ids` was sampled, or `cut`: the turn reached its cap). `tokens`: ALL
        the sample's tokens after its prompt so far (model turns and observations as
        inserted, int32), `room`: tokens it may still add (its limit minus len(tokens)).
        Must return at once: the environment step runs asynchronously."""

    def ready(self, block: bool) -> list:
        """Finished environment steps: (key, observation token ids to append, 1 <= len <=
        the room it was given) to resume that sample, or (key, None): its trajectory ended.
        block=True (the scheduler has nothing else to do) waits until one is ready."""


# eq=False: a request holds arrays (no one truth value); it is compared by identity.
@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """What to sample: `num_samples` completions of each prompt (or `samples_per_prompt[p]`
    of prompt p), at most `max_new_tokens` tokens each (or `max_new_per_prompt[p]`, at most
    that), drawn with `sampling` (greedy by default), a sample ending at any of `eos_ids`
    (kept in its tokens). These two override the engine's own (another compiled decode
    program for each distinct setting).

    `max_new_fn(sample_id) -> n` (benchmarks: `Setup.max_new_fn`, forced lengths) stops that
    sample after max(1, min(n, its prompt's limit)) tokens, as if its end token came; it is
    asked once per sample, when the sample is first admitted (a stateful one draws in
    admission order). Multimodal prompts give `prompt_embeds` (per prompt [T', D], T' >= T,
    visual rows spliced in) and `prompt_positions` (per prompt [3, T] M-RoPE positions).

    `stop_fn(finished, sampled) -> bool` is asked after every collected decode call, with the
    (p, g) samples that call finished and the tokens sampled so far; True stops the rollout
    there: a live sample returns what it sampled (a multi-turn one waiting on its
    environment too), one not started (or preempted, single-turn) nothing. `stop_below` (with
    `stop_fn`): also stop once no sample waits and fewer than that many slots are live (the
    rollout's tail, where a decode step costs nearly as much for few rows). `kept[p]` (a
    `Kept` handle or None per prompt; a prompt of one sample: its prompt and tokens so far)
    resumes that sample in a slot without a prefill; `keep_kv` leaves each stopped live
    sample's pages in the engine's pool (`Result.kept`).

    Multi-turn (`turns` set): every end token (`eos_ids` or `turn_end_ids`) ends a model turn,
    and so does `max_turn_tokens` tokens in one turn (0: no cap) or, for benchmarks,
    `max_turn_fn(sample_id, turn) -> n` (a cap per turn, asked once a turn); `turns` then says
    whether the trajectory goes on (an observation) or ends. `max_new_tokens` caps the whole
    trajectory, observations included: a sample that reaches it ends there ("length"). Text
    prompts only."""
    prompts: Sequence
    max_new_tokens: int
    num_samples: int = 1
    seed: int = 0
    sampling: SamplingParams = SamplingParams()
    eos_ids: Sequence[int] = ()
    samples_per_prompt: Optional[Sequence[int]] = None
    max_new_per_prompt: Optional[Sequence[int]] = None
    max_new_fn: Optional[Callable[[int], int]] = None
    prompt_embeds: Optional[Sequence] = None
    prompt_positions: Optional[Sequence] = None
    stop_fn: Optional[Callable[[list, int], bool]] = None
    stop_below: int = 0
    kept: Optional[Sequence] = None
    keep_kv: bool = False
    turns: Optional[Turns] = None
    turn_end_ids: Sequence[int] = ()
    max_turn_tokens: int = 0
    max_turn_fn: Optional[Callable[[int, int], int]] = None

    def __post_init__(self):
        # Frozen, so set through object: the end tokens as tuples of ints.
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        object.__setattr__(self, "turn_end_ids", tuple(int(e) for e in self.turn_end_ids))
        if self.turns is None and (self.turn_end_ids or self.max_turn_tokens
                                   or self.max_turn_fn is not None):
            raise ValueError("generate: turn_end_ids / max_turn_tokens / max_turn_fn need "
                             "turns (a multi-turn rollout)")
        if self.max_turn_tokens < 0:
            raise ValueError(f"max_turn_tokens must be >= 0 (0: no cap), got "
                             f"{self.max_turn_tokens}")
        if self.turns is not None and self.prompt_embeds is not None:
            raise ValueError("generate: multi-turn rollouts take text prompts only (a released "
                             "sample is prefilled again from its token ids)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        P = len(self.prompts)
        counts, max_new = self.counts, self.max_new
        if len(counts) != P or len(max_new) != P:
            raise ValueError(f"generate: {P} prompts but {len(counts)} samples_per_prompt and "
                             f"{len(max_new)} max_new_per_prompt")
        if min(counts, default=1) < 1 or not all(1 <= n <= self.max_new_tokens
                                                 for n in max_new):
            raise ValueError(f"generate: samples_per_prompt must be >= 1 and max_new_per_prompt "
                             f"in [1, {self.max_new_tokens}]: {counts}, {max_new}")
        if (self.prompt_embeds is None) != (self.prompt_positions is None):
            raise ValueError("generate: multimodal prompts need both prompt_embeds and "
                             "prompt_positions")
        if self.prompt_embeds is not None and not (
                len(self.prompt_embeds) == len(self.prompt_positions) == P):
            raise ValueError(f"generate: {P} prompts but {len(self.prompt_embeds)} "
                             f"prompt_embeds and {len(self.prompt_positions)} prompt_positions")

    @property
    def P(self) -> int:
        return len(self.prompts)

    @property
    def counts(self) -> list[int]:
        """[P] samples of each prompt."""
        if self.samples_per_prompt is None:
            return [self.num_samples] * self.P
        return [int(n) for n in self.samples_per_prompt]

    @property
    def max_new(self) -> list[int]:
        """[P] tokens each of a prompt's samples samples at most."""
        if self.max_new_per_prompt is None:
            return [self.max_new_tokens] * self.P
        return [int(n) for n in self.max_new_per_prompt]

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The token ids that stop a decode row: end tokens, and turn ends when multi-turn."""
        return self.eos_ids + tuple(t for t in self.turn_end_ids if t not in self.eos_ids)

    def first_ids(self) -> list[int]:
        """[P] the sample id of each prompt's first sample."""
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(int).tolist()

    def multimodal(self, p: int) -> tuple:
        """Prompt p's (embeds, positions), or () for a text prompt."""
        if self.prompt_embeds is None:
            return ()
        return self.prompt_embeds[p], self.prompt_positions[p]


def check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
    """Prompts as int32 arrays; a prompt that is not a non-empty 1-D sequence of ids in
    [0, vocab_size) raises ValueError naming it."""
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of token ids, got "
                             f"shape {a.shape} dtype {a.dtype}")
        if a.min() < 0 or a.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): "
                             f"min {a.min()}, max {a.max()}")
        out.append(a.astype(np.int32))
    return out


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the scheduler runs a request on an engine (the engine's own sizes are
    `engine_config`'s).

    `steps_per_call`: decode steps a call runs. `reserve_pages`: each sample gets all the
    pages it may write at admission (fewer samples fit at once, none is preempted), instead
    of pages grown a call's worth ahead of it. `overlap_admission`: while samples wait, the
    next decode call is launched before the last is collected too (the slots a call frees are
    refilled a call later, their rows idle through one more call), so the host's collection,
    admission and page growth run while the device decodes; once no sample waits, calls
    always overlap so.

    `turn_order` (multi-turn): which waiting sample a free slot takes. "least_progress": a
    new trajectory first, then the resumed one with the fewest turns (then model tokens)
    done, so every trajectory of the batch is under way at once and the laggards catch up:
    the batch ends when its total work does, not one whole trajectory after its last start
    (a trajectory's turns run one after another, so a trajectory started late is a tail of
    its own: on the multi-turn bench, "arrival" spent half its decode calls draining).
    "arrival": resumed samples in the order their observations came, new ones only when none
    is queued."""
    steps_per_call: int = STEPS_PER_CALL
    reserve_pages: bool = False
    overlap_admission: bool = False
    turn_order: str = "least_progress"

    def __post_init__(self):
        if self.turn_order not in TURN_ORDERS:
            raise ValueError(f"Policy.turn_order={self.turn_order!r}: one of {TURN_ORDERS}")


TURN_ORDERS = ("least_progress", "arrival")


@dataclasses.dataclass(frozen=True, eq=False)
class Result:
    """What a rollout sampled: `samples[p][g]` = (token ids int32, log-probs float32);
    `unfinished`: the (p, g) a stop cut short, sorted (a live one returned its tokens so far,
    one not started none); `kept[(p, g)]`: with `Request.keep_kv`, the `Kept` handle of a
    stopped sample's pages left in the pool (a kept sample that did not get a slot stays
    kept, under (p, 0)). `model_masks[p][g]`: int8 per token of `samples[p][g][0]`, 1 where
    the model sampled it, 0 for an observation's (whose log-prob is 0.0); all ones without
    turns. `ends[p][g]`: why it ended: "stop" (an end token; multi-turn: "done", the
    environment ended it), "length" (its token limit), "cut" (a stop cut it short).
    `stats`: the rollout's timings and counts (`lrl.rollout.state.report`; multi-turn:
    turns, observed_tokens, wait_s, blocked_s, occupancy_waiting, ...)."""
    samples: list
    unfinished: tuple = ()
    kept: dict = dataclasses.field(default_factory=dict)
    model_masks: Optional[list] = None
    ends: Optional[list] = None
    stats: dict = dataclasses.field(default_factory=dict)
