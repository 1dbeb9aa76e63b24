"""Multi-turn rollouts: the scheduler's (`lrl.rollout.scheduler`) transitions of a sample
between its model turns, over the rollout's host state (`lrl.rollout.state.Rollout`).

    pause     (from `collect`) slots whose model turn ended go WAITING: out of the decode
              rows (the device slot deactivated, the row free for another sample), their KV
              pages kept in the pool (`Engine.keep`), their records in `Rollout.paused`; the
              environment hears of each (`Turns.turn_ended`, which returns at once)
    poll      (each round) the environment steps that finished (`Turns.ready`): an
              observation is appended to its sample's tokens (log-prob 0, model mask 0) and
              the sample queued to resume (`Rollout.turn_queue`); None ends the trajectory
    admit     (from the scheduler's `admit`; by `Policy.turn_order`, after new samples and
              the laggards first, or before new samples in arrival order) queued samples
              take free slots: with their pages still held, the slot gets them, grown, and
              only their last sampled token and the observation are prefilled after them
              (`Engine.extend_slot`, `run_extend`: `prefill_chunk` calls of a few bucketed
              lengths, so no program compiles per turn); with their pages released, their
              whole history is prefilled again as a prompt of one sample
    cut_short (a stop) waiting samples return their tokens so far, their pages released

Memory rule: a waiting sample's pages stay in the pool until live work runs short of pages;
then growing the live slots, or resuming another waiting sample, releases waiting samples'
pages, the most recently paused first (`release_one`: its step likely finishes last), before
the scheduler preempts any live sample. New samples are admitted from free pages only, so a
waiting sample is never released to start a new one. A preempted multi-turn sample comes
back first, its history prefilled again, and its turn goes on from its last token.

A sample's draws go on across its turns (its decode steps keyed by (sample, model tokens so
far)), so its turns never reuse a key.

P prompts · G samples per prompt · T prompt tokens.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from lrl.rollout.state import Phase, Rollout, Slot, done


def turn_cap(r: Rollout, sample_id: int, turn: int) -> int:
    """Tokens model turn `turn` of a sample may sample (0: no cap)."""
    fn = r.request.max_turn_fn
    return max(1, int(fn(sample_id, turn))) if fn is not None else r.request.max_turn_tokens


def turn_left(slot: Slot) -> int:
    """Tokens the sample may still sample in its current turn: its room, within its cap."""
    left = slot.limit - slot.sampled
    if slot.turn_cap:
        left = min(left, slot.turn_cap - (slot.sampled - slot.turn_start))
    return left


def pause(r: Rollout, ended: list) -> None:
    """`ended`: (slot index, record, cut) of slots whose model turn ended; they go WAITING,
    their pages kept, and the environment hears of each."""
    slots = [s for s, _, _ in ended]
    last = [int(rec.tokens[-1][-1]) if len(rec.tokens[-1]) else int(rec.history()[-1])
            for _, rec, _ in ended]
    r.device, handles = r.engine.keep(r.device, slots, [r.slots[s].cached for s in slots],
                                      last, [r.slots[s].rope_delta for s in slots])
    now = time.perf_counter()
    for (s, rec, _), k in zip(ended, handles):
        rec.phase, rec.kept, rec.paused_at = Phase.WAITING, k, now
        rec.turn += 1
        r.paused[rec.sample] = rec
        r.slots[s] = Slot()
        r.admitted.remove(s)
        r.free.append(s)
    r.st["turns"] += len(ended)
    for _, rec, cut in ended:
        tokens = rec.history()
        r.request.turns.turn_ended(rec.sample, tokens, rec.limit - tokens.size, bool(cut))


def poll(r: Rollout, block: bool) -> None:
    """Takes the environment steps that finished (`block`: waits for one)."""
    t0 = time.perf_counter()
    answers = r.request.turns.ready(block)
    now = time.perf_counter()
    if block:
        r.st["blocked_s"] += now - t0
    vocab = r.engine.cfg.vocab_size
    for key, obs in answers:
        key = tuple(int(x) for x in key)
        rec = r.paused.pop(key, None)
        if rec is None:
            raise ValueError(f"Turns.ready answered for sample {key}, which is not waiting on "
                             f"its environment")
        r.st["wait_s"] += now - rec.paused_at
        if obs is None:
            _release(r, rec)
            done(r, rec, "done")
            continue
        obs = np.asarray(obs)
        room = rec.limit - rec.sampled
        if (obs.ndim != 1 or not 1 <= obs.size <= room
                or not np.issubdtype(obs.dtype, np.integer)
                or obs.min() < 0 or obs.max() >= vocab):
            raise ValueError(f"Turns.ready: sample {key}'s observation must be 1 to {room} (its "
                             f"room) token ids in [0, {vocab}), got shape {obs.shape} dtype "
                             f"{obs.dtype}" + (f", ids {obs.min()}..{obs.max()}"
                                               if obs.size and obs.ndim == 1 else ""))
        obs = obs.astype(np.int32)
        rec.spans.append((rec.sampled, obs.size))
        rec.tokens.append(obs)
        rec.logps.append(np.zeros(obs.size, np.float32))
        rec.observed += obs.size
        r.st["observed_tokens"] += obs.size
        if rec.sampled >= rec.limit:   # no room left to sample
            _release(r, rec)
            done(r, rec, "length")
            continue
        rec.pending = obs
        rec.turn_start = rec.sampled
        rec.turn_cap = turn_cap(r, r.first_id[key[0]] + key[1], rec.turn)
        r.turn_queue.append(rec)


def admit(r: Rollout, keep: int, plans: list, new_prefixes: list, closed: list):
    """Queued samples (`turn_queue`, in order) into free slots while the pool holds their
    pages beside `keep` (what the live slots need through the next two calls), releasing
    other waiting samples' pages when short. Plans go to `plans`; the prefixes of samples
    prefilled again to `new_prefixes` and `closed`. -> (keep, with theirs; the `Extension`s
    to prefill)."""
    e = r.engine
    extensions = []
    if r.policy.turn_order == "least_progress" and len(r.turn_queue) > 1:
        # the laggards first (stable: a preempted sample, queued first, stays ahead of equals)
        r.turn_queue = collections.deque(sorted(r.turn_queue, key=_progress))
    while r.free and r.turn_queue:
        rec = r.turn_queue[0]
        p, g = rec.sample
        left, first, length, held, need = _resume_need(r, rec)
        if e.pool.num_free - keep < need:
            if _reclaim(r, keep + need, rec):
                continue   # its own pages may have gone: its need is counted anew
            break
        s = r.free.popleft()
        r.turn_queue.popleft()
        sid, model = r.first_id[p] + g, rec.sampled - rec.observed
        if held:
            plan, ext = e.extend_slot(rec.kept, s, sid, left, rec.pending, first_tokens=first,
                                      steps=model)
            extensions.append(ext)
            r.st["prefill_tokens"] += ext.tokens.size
        else:
            _release(r, rec)
            history = np.concatenate([r.prompts[p], rec.history()])
            pre = e.reserve_prefix(history)
            new_prefixes.append(pre)
            closed.append(pre)
            plan = e.reserve_slot(pre, s, sid, left, last=True, first_tokens=first)
            plan.steps = model
            r.st["refilled"] += 1
            r.st["prefill_tokens"] += length - 1
        plan.remaining = left
        rec.phase, rec.kept, rec.pending = Phase.LIVE, None, None
        rec.cached, rec.since = length - 1, r.launched
        r.slots[s] = rec
        r.admitted.append(s)
        plans.append(plan)
        if r.grow:
            keep += e.pages_short(s, min(rec.cached + 2 * r.policy.steps_per_call + 1,
                                         len(r.prompts[p]) - 1 + rec.limit))
    return keep, extensions


def _resume_need(r: Rollout, rec: Slot):
    """-> (tokens its turn may sample, the first call's share of them, its whole history's
    length (prompt included), whether its pages are still held, the pages it needs to take a
    slot). Asked of every queued sample each round (`queued_pages`): counts only, no copy of
    its tokens."""
    e = r.engine
    left = turn_left(rec)
    first = min(r.policy.steps_per_call, left) if r.grow else left
    length = len(r.prompts[rec.sample[0]]) + rec.sampled
    held = rec.kept is not None and rec.pending is not None and e.holds(rec.kept)
    need = (e.extend_pages(rec.kept, rec.pending.size, first) if held else
            e.sample_pages(length, first) + e.prefix_pages(length))
    return left, first, length, held, need


def queued_pages(r: Rollout) -> int:
    """Pages the samples queued to resume need to take a slot: what a new sample admitted
    ahead of them must leave free, so that it never costs one of them its kept pages."""
    return sum(_resume_need(r, rec)[4] for rec in r.turn_queue)


def _progress(rec: Slot) -> tuple[int, int]:
    """How far a trajectory has come: its turns, then its model tokens."""
    return rec.turn, rec.sampled - rec.observed


def _reclaim(r: Rollout, need: int, rec: Slot) -> bool:
    from lrl.rollout.scheduler import reclaim   # the scheduler's order of what goes first
    return reclaim(r, need, waiting=True, spare=rec)


def held(r: Rollout) -> set:
    """ids of the `Kept` handles of this rollout's multi-turn samples."""
    recs = list(r.paused.values()) + list(r.turn_queue)
    return {id(x.kept) for x in recs if x.kept is not None}


def release_one(r: Rollout, spare=None) -> bool:
    """Releases the pages of the most recently paused sample that holds any (never
    `spare`'s; queued samples last): it is prefilled again when it resumes. -> whether one
    was released."""
    for rec in list(reversed(r.paused.values())) + list(reversed(r.turn_queue)):
        if rec is not spare and rec.kept is not None and r.engine.holds(rec.kept):
            _release(r, rec)
            r.st["waiting_released"] += 1
            return True
    return False


def _release(r: Rollout, rec: Slot) -> None:
    if rec.kept is not None:
        r.engine.release_kept([rec.kept])
        rec.kept = None


def cut_short(r: Rollout) -> list:
    """After a stop: waiting samples (on their environment or for a slot) end "cut" with
    their tokens so far, their pages released. -> their (p, g)."""
    recs = list(r.paused.values()) + list(r.turn_queue)
    for rec in recs:
        _release(r, rec)
        done(r, rec, "cut", finished=False)
    r.paused.clear()
    r.turn_queue.clear()
    return [rec.sample for rec in recs]
