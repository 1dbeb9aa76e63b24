"""Partial rollouts: the host bookkeeping of groups whose samples outlive one step's rollout.

With `rollout.partial`, a step's rollout stops once a decode-token budget is spent or enough
groups have finished (the `Request`'s `stop_fn`); the samples still running are carried, as
`Pending` groups, into the next step's rollout, where each comes back as a prompt of its own:
its prompt and the tokens it has so far, then decoded on under the new weights. Every token
keeps the log-prob its sampler gave it and that sampler's policy version (the step whose
parameters drew it), so the update weighs each token against the policy that really drew it.
A group trains once all its samples have finished; a group whose oldest token is more than
`max_staleness` versions old is dropped, and counted.

How a carried sample resumes (`rollout.partial_keep_kv`): its KV pages stay in the engine's
pool (`Sample.kept`, an `lrl.rollout.engine.Kept` handle) and the next rollout puts it straight
back in a slot; else, or once its pages had to go (the pool short for new work, a resume from
a checkpoint, which saves no KV, another engine), it is prefilled again. The kept keys and
values were computed by the policy that drew the tokens, not by the new weights a re-prefill
would use: an approximation (AReaL's and slime's), taken because it saves the re-prefill
(seconds a step for long carried samples), and harmless to the update's correction, since
each token's behaviour log-prob is still the one its sampler gave it, whatever that sampler
attended to. With unchanged weights both paths are exact (a prefill writes the keys and
values a decode step would). A handle holds pool pages: every path that drops a carried
sample releases it (`Engine.release_kept` of `kept_of(...)`).

All functions here are pure: they take and return tuples of frozen records.

P prompts · G samples per prompt.
"""
from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Optional

import numpy as np


def _empty(dtype):
    return dataclasses.field(default_factory=lambda: np.zeros(0, dtype))


# eq=False: records compare by identity (their arrays have no one truth value).
@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One sample so far."""
    tokens: np.ndarray = _empty(np.int32)     # sampled so far (ending with EOS once done)
    logps: np.ndarray = _empty(np.float32)    # each one's log-prob under the policy that drew it
    versions: np.ndarray = _empty(np.int32)   # that policy's version (the step that sampled it)
    done: bool = False
    kept: Optional[object] = None   # an unfinished sample's KV in the engine's pool (`Kept`)
    # multi-turn (`rollout.env`, `lrl.partial_turns`): 1 where the model sampled the token, 0
    # for an observation's; and the trajectory's turn state (`lrl.partial_turns.TurnState`)
    mask: np.ndarray = _empty(np.int8)
    turn: Optional[object] = None

    def oldest(self) -> Optional[int]:
        return int(self.versions.min()) if self.versions.size else None

    def extend(self, tokens, logps, version: int, done: bool, kept=None, mask=None,
               turn=None) -> "Sample":
        """The sample with `tokens` appended (drawn by policy `version`); multi-turn: `mask`
        their model mask, `turn` the turn state after them."""
        tokens = np.asarray(tokens, np.int32)
        mask = self.mask if mask is None else np.concatenate(
            [self.mask, np.asarray(mask, np.int8)])
        return Sample(np.concatenate([self.tokens, tokens]),
                      np.concatenate([self.logps, np.asarray(logps, np.float32)]),
                      np.concatenate([self.versions, np.full(tokens.size, version, np.int32)]),
                      done, kept, mask, turn)


@dataclasses.dataclass(frozen=True, eq=False)
class Pending:
    """A group in flight: its prompt (the task's `Prompt`) and its G samples."""
    prompt: object
    samples: tuple

    @staticmethod
    def fresh(prompt, group_size: int) -> "Pending":
        return Pending(prompt, (Sample(),) * group_size)

    @property
    def complete(self) -> bool:
        return all(x.done for x in self.samples)

    def oldest(self) -> Optional[int]:
        old = [v for v in (x.oldest() for x in self.samples) if v is not None]
        return min(old) if old else None


def kept_of(pending) -> list:
    """The kept handles of the groups' samples (to release when the groups go)."""
    return [x.kept for g in pending for x in g.samples if x.kept is not None]


def drop_stale(pending: tuple, version: int, max_staleness: int) -> tuple[tuple, int, int]:
    """-> (kept groups, groups dropped, samples dropped): a group whose oldest token was drawn
    more than `max_staleness` versions before `version` can only get older, so it goes (its
    finished samples with it: the group's advantage needs them all)."""
    fresh = [g.oldest() is None or version - g.oldest() <= max_staleness for g in pending]
    gone = [g for g, ok in zip(pending, fresh) if not ok]
    return (tuple(g for g, ok in zip(pending, fresh) if ok), len(gone),
            sum(len(g.samples) for g in gone))


def requests(pending: tuple, max_new_tokens: int):
    """What the rollout runs for the unfinished samples of `pending`: -> (prompt ids [N],
    samples per prompt [N], tokens each may still sample [N], index: for each request, the
    (group, sample) of its samples). Samples not yet begun share one request of their prompt
    (one prefill, shared pages); a begun one is a request of its own, its prompt followed by
    its tokens so far."""
    ids, counts, max_new, index = [], [], [], []
    for i, group in enumerate(pending):
        fresh = [g for g, x in enumerate(group.samples) if not x.done and x.tokens.size == 0]
        if fresh:
            ids.append(np.asarray(group.prompt.ids, np.int32))
            counts.append(len(fresh))
            max_new.append(max_new_tokens)
            index.append([(i, g) for g in fresh])
        for g, x in enumerate(group.samples):
            if not x.done and x.tokens.size:
                ids.append(np.concatenate([np.asarray(group.prompt.ids, np.int32), x.tokens]))
                counts.append(1)
                max_new.append(max_new_tokens - x.tokens.size)
                index.append([(i, g)])
    return ids, counts, max_new, index


def stop_rule(pending: tuple, index: list, target_groups: int, token_budget: int,
              seconds: float = 0.0):
    """The `Request`'s stop_fn: stop once `target_groups` groups are complete (those complete
    already count), `token_budget` tokens have been sampled (0: no budget) or `seconds` have
    passed since this rule was made, just before the rollout (0: no time budget)."""
    left = [sum(not x.done for x in g.samples) for g in pending]
    complete = [sum(n == 0 for n in left)]
    deadline = time.monotonic() + seconds if seconds > 0 else None

    def stop(finished: list, sampled: int) -> bool:
        for p, g in finished:
            i, _ = index[p][g]
            left[i] -= 1
            complete[0] += left[i] == 0
        return (complete[0] >= target_groups or (token_budget > 0 and sampled >= token_budget)
                or (deadline is not None and time.monotonic() >= deadline))
    return stop


def advance(pending: tuple, index: list, results: list, unfinished, version: int,
            kept: Optional[dict] = None) -> tuple:
    """`pending` after one rollout: each request's tokens appended to its sample, drawn by
    policy `version`; a sample is done unless `(p, g)` is in `unfinished`; `kept[(p, g)]`:
    the handle of its pages left in the pool (`Result.kept`)."""
    samples = [list(g.samples) for g in pending]
    stopped = set(map(tuple, unfinished))
    kept = kept or {}
    for p, per in enumerate(results):
        for g, (tokens, logps) in enumerate(per):
            i, j = index[p][g]
            samples[i][j] = samples[i][j].extend(tokens, logps, version, (p, g) not in stopped,
                                                 kept.get((p, g)))
    return tuple(Pending(grp.prompt, tuple(s)) for grp, s in zip(pending, samples))


def take_complete(pending: tuple, n: int) -> tuple[tuple, tuple]:
    """-> (up to `n` complete groups, oldest first; the rest, in their order)."""
    order = sorted(range(len(pending)), key=lambda i: (pending[i].oldest() or 0, i))
    take = set([i for i in order if pending[i].complete][:n])
    return (tuple(pending[i] for i in sorted(take, key=order.index)),
            tuple(g for i, g in enumerate(pending) if i not in take))


def carried_metrics(pending: tuple, version: int) -> dict:
    """What is carried into the next step: unfinished samples, their groups, their age (policy
    versions since their first token; those not yet begun are not counted)."""
    live = [x for g in pending for x in g.samples if not x.done]
    ages = [version - x.oldest() for x in live if x.oldest() is not None]
    return {"partial/carried_samples": len(live),
            "partial/carried_groups": sum(not g.complete for g in pending),
            "partial/carried_complete_groups": sum(g.complete for g in pending),
            "partial/carried_age_mean": float(np.mean(ages)) if ages else 0.0,
            "partial/carried_age_max": float(max(ages)) if ages else 0.0}


# ----------------------------------------------------------------------------- checkpoint

def to_state(pending: tuple, prompt_to_state) -> list:
    """The groups as JSON data for the checkpoint's data state, so a resume continues the same
    samples: tokens and versions as ints, log-probs as their float32 bytes (bit-exact);
    `prompt_to_state` turns each group's prompt into JSON (the task's, which knows its fields).
    A trajectory's (`rollout.env`) model mask goes with it, and its turn state (the
    environment's state, counts, per-turn rewards) as pickle bytes: an environment is any
    Python object the reward workers can take, which JSON cannot hold."""
    return [{"prompt": prompt_to_state(g.prompt), "samples": [_sample_state(x) for x in g.samples]}
            for g in pending]


def _sample_state(x: Sample) -> dict:
    out = {"tokens": x.tokens.tolist(), "versions": x.versions.tolist(),
           "logps": np.asarray(x.logps, "<f4").tobytes(), "done": bool(x.done)}
    if x.mask.size or x.turn is not None:
        out.update(mask=x.mask.tolist(), turn=pickle.dumps(x.turn))
    return out


def from_state(state: list, prompt_from_state) -> tuple:
    """The inverse of `to_state`; a malformed entry raises ValueError naming the group."""
    out = []
    for i, g in enumerate(state):
        try:
            samples = []
            for x in g["samples"]:
                tokens = np.asarray(x["tokens"], np.int32)
                logps = np.frombuffer(x["logps"], "<f4").astype(np.float32)
                versions = np.asarray(x["versions"], np.int32)
                if not tokens.ndim == 1 or not tokens.shape == logps.shape == versions.shape:
                    raise ValueError(f"tokens, log-probs and versions of lengths "
                                     f"{tokens.shape}, {logps.shape}, {versions.shape}")
                mask = np.asarray(x.get("mask", ()), np.int8)
                if "mask" in x and mask.shape != tokens.shape:
                    raise ValueError(f"{tokens.size} tokens but a model mask of {mask.size}")
                turn = pickle.loads(x["turn"]) if "turn" in x else None
                samples.append(Sample(tokens, logps, versions, bool(x["done"]), None, mask,
                                      turn))
            out.append(Pending(prompt_from_state(g["prompt"]), tuple(samples)))
        except (KeyError, TypeError, ValueError, pickle.UnpicklingError, AttributeError,
                ImportError) as e:
            raise ValueError(f"carried group {i}: {type(e).__name__}: {e}") from e
    return tuple(out)
