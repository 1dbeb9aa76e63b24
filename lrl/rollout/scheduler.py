"""The rollout's continuous batching: a scheduler of samples into the engine's decode slots, as
module functions over one host state (`Rollout`) and the engine (`lrl.rollout.engine`).

    result = scheduler.run(engine, params, Request(prompts, max_new_tokens=256, num_samples=8))
    tokens, logps = result.samples[p][g]

`run` is a loop of four transitions until no sample waits or runs, or a stop:
    admit            free slots take waiting samples, preempted ones first, then the head
                     prompt's next: a prompt is prefilled when its first sample is admitted,
                     and its samples then read its pages (a kept sample resumes with no
                     prefill); a sample is admitted while the pool holds its first pages
                     beside what the live slots need through the next two calls
    grow_or_preempt  pages for every token the next call (and the one in flight) may write;
                     when the pool runs short, kept samples' pages go first (`reclaim`), then
                     the youngest samples are preempted (`preempt`: pages freed, run again
                     from their start later, drawing the same tokens)
    launch           one decode call of `Policy.steps_per_call` steps over the slots (only the
                     live rows, a narrower program, once no sample waits and they fit one)
    settle           the call collected at once (`collect`: tokens appended to their slots,
                     finished slots freed) while samples wait, so its freed slots are refilled
                     before the next call; once none waits (or with `overlap_admission`),
                     kept in flight and collected after the next call's launch, so the
                     device does not idle while the host reads tokens back
and `stopped` asks the request's stop rule after each round; `finish` collects the last
call, returns what a stop cut short (live samples their tokens so far, waiting ones none;
with `keep_kv` the live ones' pages stay in the pool) and hands the engine its state back.

A sample is FREE, LIVE or WAITING (`Slot.phase`): LIVE from admission to the collection that
sees it end. Multi-turn rollouts (`Request.turns`, `lrl.rollout.turns`) add WAITING: when
`collect` sees a model turn end (an end token, a turn-end token such as a tool call's close,
or the turn's cap), the sample leaves its decode row (the device slot deactivated, the row
free for another sample) but keeps its KV pages (`Engine.keep`), and its environment step
starts (`Turns.turn_ended`). Each round `run` polls the finished steps (`turns.poll`,
blocking only when no slot is live and none can be admitted); an observation sends the
sample back in (new trajectories and the laggards first, `Policy.turn_order`): its last
token and the observation are prefilled after its pages into whichever slot it gets
(`Engine.extend_slot` / `run_extend`: no re-prefill of its history), and it decodes on.
Memory rule: a waiting sample's pages stay in the pool until live work runs short: growing
live slots, or resuming another waiting sample, releases
waiting samples' pages (the most recently paused first) before any live sample is preempted;
new samples are admitted from free pages only. A sample whose pages went is prefilled again,
its whole history (prompt, tokens, observation), when it resumes; so is a preempted one
(its turn goes on from its last token: nothing is sampled twice).

P prompts · G samples per prompt · B batch rows: the engine's slots · T prompt tokens.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import jax
import numpy as np

from lrl.rollout import turns
from lrl.rollout.engine import Engine
from lrl.rollout.request import Policy, Request, Result
from lrl.rollout.state import Call, Phase, Rollout, Slot, report, start
from lrl.rollout.state import done as finished


def run(engine: Engine, params, request: Request, *, policy: Policy = Policy(),
        decode_params=None, prefill_fn: Optional[Callable] = None,
        stats: Optional[dict] = None) -> Result:
    """Samples `request` on `engine` (its pool, slots and compiled programs). `decode_params`:
    the weights already in the engine's decode layout (`lrl.rollout.weights.DecodeWeights`),
    else relaid here. `prefill_fn(engine, params, state, prefixes) -> state` replaces
    `engine.run_prefill` (e.g. `lrl.rollout.sp_prefill.make_prefill(mesh)`). `stats`, when a
    dict, is filled with timings and counts (`report`)."""
    if request.P == 0:
        return Result([], model_masks=[], ends=[])
    r = start(engine, params, request, policy, decode_params, prefill_fn, stats is not None)
    while r.waiting() or r.admitted or r.paused:
        if r.multi:
            turns.poll(r, block=False)
        admit(r)
        if not r.admitted:
            if r.in_flight is not None:   # it may end turns
                collect(r, r.in_flight)
                r.in_flight = None
            if r.paused and not r.turn_queue:   # nothing else can run
                turns.poll(r, block=True)
                continue
            if r.waiting():
                raise RuntimeError("no sample could be admitted although the pool is empty; "
                                   "this is a bug in the page accounting")
            break
        grow_or_preempt(r)
        settle(r, launch(r))
        if stopped(r):
            break
    return finish(r, stats)


# ----------------------------------------------------------------------------- admit

def admit(r: Rollout) -> None:
    """Fills free slots from the waiting samples while the pool holds their first pages
    beside what the live slots need to grow through the next two calls; prefills the prompts
    new among them and inserts them all. Multi-turn: new trajectories and resumed ones in
    `Policy.turn_order`."""
    e, k = r.engine, r.policy.steps_per_call
    new_prefixes, plans, closed = [], [], []
    t0 = time.perf_counter()
    keep = sum(e.pages_short(s, r.slots[s].cached + 2 * k + 1) for s in r.admitted) \
        if r.grow else 0
    if r.multi and r.policy.turn_order == "least_progress":
        # New samples from the pages the queued ones leave (none is released for them).
        queued = turns.queued_pages(r)
        keep = _admit_new(r, keep + queued, plans, new_prefixes, closed,
                          whole=bool(r.paused or r.turn_queue)) - queued
        keep, extensions = turns.admit(r, keep, plans, new_prefixes, closed)
    else:
        keep, extensions = turns.admit(r, keep, plans, new_prefixes, closed)
        # Resumed samples first; new ones too if none of those fits and no slot is live (a
        # prompt's open prefix holds pages until its last sample is admitted).
        if not r.turn_queue or not r.admitted:
            keep = _admit_new(r, keep, plans, new_prefixes, closed)
    r.st["peak_pages"] = max(r.st["peak_pages"], e.pool.num_used)
    r.st["host_admit_s"] += time.perf_counter() - t0
    if new_prefixes or extensions:
        _prefill(r, new_prefixes, extensions)
    if plans:
        r.device = e.run_insert(r.device, plans)
    for pre in closed:   # only now: its partial page has been copied
        e.release(pre)


def _admit_new(r: Rollout, keep: int, plans: list, new_prefixes: list, closed: list,
               whole: bool = False) -> int:
    """New (and preempted single-turn) samples into free slots while the pool holds their
    first pages beside `keep` (`whole`: every page each may write, so that a trajectory
    started while others wait on their tools never takes the pages those keep). -> keep,
    with theirs."""
    e, k = r.engine, r.policy.steps_per_call
    while r.free and (r.queue or r.redo):
        p, g, last = _head(r)
        T, sid = len(r.prompts[p]), r.first_id[p] + g
        n = _limit(r, p, sid)
        first = min(k, n) if r.grow else None
        kept = None if r.redo else r.resume.get(p)
        ask = n if first is None or whole else first
        if kept is not None:
            need = e.resume_pages(kept, ask)
        else:
            need = e.sample_pages(T, ask)
            if p not in r.open_prefix:
                need += e.prefix_pages(T)
        if e.pool.num_free - keep < need:
            if reclaim(r, keep + need):
                continue   # with the head's own kept pages gone, its need is counted anew
            break
        slot = r.free.popleft()
        plans.append(_place(r, slot, (p, g), sid, n, first, last, kept, new_prefixes))
        if r.grow:
            keep += e.pages_short(slot, min(T - 1 + 2 * k + 1, T - 1 + n))
        if r.redo:
            r.redo.popleft()
        else:
            r.next_sample[p] += 1
            if r.next_sample[p] == r.counts[p]:
                r.queue.popleft()
        if last and p in r.open_prefix:
            closed.append(r.open_prefix.pop(p))
    return keep


def _head(r: Rollout) -> tuple[int, int, bool]:
    """The next sample to admit: (p, g, whether it is the last its prefix serves). A
    preempted one gets a prefix of its own unless its prompt still admits samples."""
    if r.redo:
        p, g = r.redo[0]
        return p, g, not (r.queue and r.queue[0] == p)
    p = r.queue[0]
    g = r.next_sample[p]
    return p, g, g == r.counts[p] - 1


def _limit(r: Rollout, p: int, sample_id: int) -> int:
    """Tokens a sample samples at most (the same if it is preempted and run again)."""
    if sample_id not in r.limits:
        cap, fn = r.max_new[p], r.request.max_new_fn
        r.limits[sample_id] = cap if fn is None else max(1, min(cap, int(fn(sample_id))))
    return r.limits[sample_id]


def _place(r: Rollout, slot: int, sample: tuple[int, int], sid: int, n: int, first,
           last: bool, kept, new_prefixes: list):
    """Sample (p, g), id `sid`, into `slot`, to sample `n` tokens at most: a kept sample
    resumed from its pages, else a sample of the prompt's prefix (reserved, and listed in
    `new_prefixes` to prefill, when it is the prompt's first); pages for all it may write or,
    growing, its `first` tokens. -> its insert plan."""
    p = sample[0]
    e, cap = r.engine, r.max_new[p]
    if kept is not None:
        del r.resume[p]
        plan = e.resume_slot(kept, slot, sid, cap, first_tokens=first)
        r.st["kept_resumed"] += 1
    else:
        if p not in r.open_prefix:
            pre = r.open_prefix[p] = e.reserve_prefix(r.prompts[p], *r.request.multimodal(p))
            r.st["prompt_pages"] += len(pre.pages)
            r.st["prefill_tokens"] += len(r.prompts[p]) - 1
            r.prefilled.append(p)
            new_prefixes.append(pre)
        plan = e.reserve_slot(r.open_prefix[p], slot, sid, cap, last=last, first_tokens=first)
    if n < cap:   # a forced length (benchmarks): it stops early
        plan = dataclasses.replace(plan, remaining=n)
    r.slots[slot] = Slot(sample, Phase.LIVE, limit=n, cached=len(r.prompts[p]) - 1,
                         rope_delta=plan.rope_delta, since=r.launched)
    r.admitted.append(slot)
    if r.multi:   # its first turn may stop sooner
        r.slots[slot].turn_cap = turns.turn_cap(r, sid, 0)
        plan = dataclasses.replace(plan, remaining=turns.turn_left(r.slots[slot]))
    return plan


def _prefill(r: Rollout, prefixes: list, extensions: list = ()) -> None:
    """Fills the new prompts' pages, and resumed multi-turn samples' observations after
    theirs. Prefill reads the decode layout too: no layer sliced out of a stack per call,
    joined qkv and gate/up matmuls, compute-dtype weights."""
    # Timed alone only with no decode call in flight (waiting on it would end the overlap);
    # else it is in decode_s, as what the device ran between calls. The prompts' and the
    # observations' calls are timed apart (one more wait between them, timed runs only).
    alone = r.timed and r.in_flight is None
    t0 = time.perf_counter()
    if prefixes:
        r.device = (r.engine.run_prefill(r.dparams, r.device, prefixes) if r.prefill_fn is None
                    else r.prefill_fn(r.engine, r.params, r.device, prefixes))
        r.st["prompts_prefilled"] += len(prefixes)
        if alone:
            jax.block_until_ready(r.device.k_pages)
            r.st["prefill_prompts_s"] += time.perf_counter() - t0
    t1 = time.perf_counter()
    if extensions:
        calls = r.engine.extend_calls(extensions)
        r.st["extend_calls"] += len(calls)
        r.device = r.engine.run_extend(r.dparams, r.device, calls)
        if alone:
            jax.block_until_ready(r.device.k_pages)
            r.st["prefill_observations_s"] += time.perf_counter() - t1
    if r.timed:
        r.st["prefill_rounds"] += 1   # admissions that prefilled
        r.st["prompt_rounds"] += bool(prefixes)
        if alone:
            jax.block_until_ready(r.device.k_pages)
            dt = time.perf_counter() - t0
            r.t_prefill += dt
            if r.t_decode0 is not None:
                r.t_prefill_decoding += dt


# ----------------------------------------------------------------------------- pages

def grow_or_preempt(r: Rollout) -> None:
    """Pages for every token the next call (and the one in flight) may write; when the pool
    is short, kept samples' pages go first, then the youngest samples are preempted (the
    call in flight collected first: only what is collected is preempted)."""
    t0 = time.perf_counter()
    if r.grow:
        e, k = r.engine, r.policy.steps_per_call
        want = _want(r, k * (2 if r.in_flight is not None else 1))
        short = sum(e.pages_short(s, n) for s, n in want.items())
        reclaim(r, short, waiting=True)
        if short > e.pool.num_free:
            if r.in_flight is not None:
                collect(r, r.in_flight)
                r.in_flight = None
                want = _want(r, k)
            while sum(e.pages_short(s, n) for s, n in want.items()) > e.pool.num_free:
                victim = r.admitted[-1]
                preempt(r, victim)
                want.pop(victim)
        changed = [e.grow(s, n) for s, n in want.items()]
        if any(changed):
            r.device = e.with_page_table(r.device)
    r.st["host_grow_s"] += time.perf_counter() - t0


def _want(r: Rollout, ahead: int) -> dict[int, int]:
    """slot -> the cache positions it may have filled `ahead` steps on."""
    return {s: min(r.slots[s].cached + ahead,
                   len(r.prompts[r.slots[s].sample[0]]) - 1 + r.slots[s].limit)
            for s in r.admitted}


def preempt(r: Rollout, s: int) -> None:
    """Stops slot s's sample and queues it to run again from its start: its draws are keyed
    by (sample, step), so it samples the same tokens again. A multi-turn sample instead goes
    back first with what it has, its history prefilled again (`turns.admit`)."""
    slot = r.slots[s]
    r.st["preempted"] += 1
    if r.multi:
        slot.phase = Phase.WAITING
        r.turn_queue.appendleft(slot)
    else:
        r.st["preempted_tokens"] += slot.sampled
        r.redo.appendleft(slot.sample)
    r.slots[s] = Slot()
    r.admitted.remove(s)
    r.free.append(s)
    r.device = r.engine.free(r.device, [s])


def reclaim(r: Rollout, need: int, waiting: bool = False, spare=None) -> bool:
    """Releases kept samples' pages until `need` pages are free: first those this rollout
    does not hold, then (`waiting`) those of multi-turn samples waiting on their environment
    (the most recently paused first, never `spare`'s), then the kept samples it resumes, the
    last in line first (they are prefilled instead). -> whether `need` pages are free."""
    e = r.engine
    while e.pool.num_free < need:
        ours = {id(k) for k in r.resume.values()} | turns.held(r)
        others = [k for k in e.kept.values() if id(k) not in ours]
        if others:
            victim = others[0]
        elif waiting and turns.release_one(r, spare):
            continue
        elif r.resume:
            victim = r.resume.pop(max(r.resume))
        else:
            return False
        e.release_kept([victim])
        r.st["kept_released"] += 1
    return True


# ----------------------------------------------------------------------------- decode

def launch(r: Rollout) -> Call:
    """One decode call of `steps_per_call` steps. With no sample waiting no slot fills before
    the next call, so a call computes only the live rows (a narrower program,
    `EngineConfig.narrow_widths`) once they fit one."""
    e, st = r.engine, r.st
    rows = None if r.waiting() else sorted(r.admitted)
    width = e.width_for(len(rows)) if rows is not None else e.ecfg.max_slots
    if r.t_decode0 is None:
        r.t_decode0 = time.perf_counter()
    r.device, out = e.generate(r.dparams, r.device, r.rng,
                               num_steps=r.policy.steps_per_call,
                               sampling=r.request.sampling, eos_ids=r.request.end_ids,
                               rows=rows)
    # Its copies back are queued now, behind this call alone: asked for only at the
    # collection, after the next call's launch, they may wait for that call too. An H200
    # trace showed the device idle between decode calls, 0.25 s of a 1.5 s rollout, as if
    # the host admitted each call's samples only after the next call had run
    # (docs/benchmark-history.md, "Seventeenth session"); whether this closes it is not
    # measured.
    for x in (out.tokens, out.logps, out.valid, out.active):
        x.copy_to_host_async()
    call = Call(out, width, r.launched)
    r.launched += 1
    st["decode_calls"] += 1
    st["narrow_calls"] += width < e.ecfg.max_slots
    st["live_slots_at_calls"] += len(r.admitted)
    return call


def settle(r: Rollout, call: Call) -> None:
    """Collects `call` at once while samples wait (its freed slots are refilled before the
    next call), and always in a multi-turn rollout (a turn's end is seen, and its environment
    step started, a call sooner); else (or always, with `overlap_admission`)
    collects the call before it and leaves this one in flight. With the decode loop's
    condition on the device (`steps._DECODE_OPTIONS`), steps were faster than when every
    call was collected before the next was launched (docs/benchmark-history.md, "Sixth
    session", "Overlap")."""
    if (r.waiting() or r.multi) and not r.policy.overlap_admission:
        if r.in_flight is not None:
            collect(r, r.in_flight)
            r.in_flight = None
        collect(r, call)
    else:
        if r.in_flight is not None:
            collect(r, r.in_flight)
        r.in_flight = call


def collect(r: Rollout, call: Call) -> None:
    """Appends a decode call's tokens to their slots' samples; frees the slots that finished.
    A slot filled after the call was launched (`overlap_admission`) is not in it."""
    st, P = r.st, r.prompts
    ended = []   # multi-turn: (slot, its sample, cut) whose model turn ended
    # Only transfers here: a jax op on the output would queue behind the call in flight.
    tokens, logps, valid, active = jax.device_get(
        (call.out.tokens, call.out.logps, call.out.valid, call.out.active))
    t_got = time.perf_counter()
    tokens, logps, valid = tokens.T, logps.T, valid.T
    done = []
    for s, slot in enumerate(r.slots):
        if slot.sample is None or slot.since > call.number:
            continue
        before = slot.sampled
        slot.tokens.append(tokens[s, valid[s]])
        slot.logps.append(logps[s, valid[s]])
        n = len(slot.tokens[-1])
        slot.cached += n
        p, g = slot.sample
        # kv tokens read by this slot's steps: T + before, ..., T + before + n - 1
        st["kv_token_steps"] += n * (len(P[p]) + before) + n * (n - 1) // 2
        if active[s]:
            continue
        last = next((int(c[-1]) for c in reversed(slot.tokens) if len(c)), -1)
        if r.multi and slot.sampled < slot.limit:
            ended.append((s, slot, last not in r.request.end_ids))
            continue
        finished(r, slot, "stop" if last in r.request.eos_ids and not r.multi else
                 "length")
        r.slots[s] = Slot()
        r.admitted.remove(s)
        done.append(s)
    steps_run = int(valid.any(axis=0).sum())
    st["decode_steps"] += steps_run
    st["computed_rows"] += steps_run * call.width   # rows computed, idle ones included
    st["sampled_tokens"] += int(valid.sum())
    if r.paused or r.turn_queue:
        st["steps_while_waiting"] += steps_run
        st["sampled_while_waiting"] += int(valid.sum())
    if done:
        r.device = r.engine.free(r.device, done)
        r.free.extend(done)
    if ended:
        turns.pause(r, ended)
    st["host_collect_s"] += time.perf_counter() - t_got


def stopped(r: Rollout) -> bool:
    """Asks the request's stop rule (partial rollouts) with the samples finished since it was
    last asked; its tail rule stops once no sample waits and fewer than `stop_below` slots
    are live."""
    q = r.request
    if q.stop_fn is None:
        return False
    done_now, r.finished_now = r.finished_now, []
    tail = (q.stop_below and not r.waiting() and not r.paused
            and len(r.admitted) < q.stop_below)
    if q.stop_fn(done_now, r.st["sampled_tokens"]) or tail:
        r.stopped = True
        r.st["stopped_in_tail"] = int(bool(tail))
    return r.stopped


# ----------------------------------------------------------------------------- finish

def finish(r: Rollout, stats: Optional[dict]) -> Result:
    """Collects the last call (nothing if every slot had finished before it, else, after a
    stop, its tokens are the samples' too), settles what a stop cut short, hands the engine
    its state back (it raises if a page not kept is still in use) and fills `stats`."""
    if r.in_flight is not None:
        collect(r, r.in_flight)
        r.in_flight = None
    t_decode = (0.0 if r.t_decode0 is None else
                time.perf_counter() - r.t_decode0 - r.t_prefill_decoding)
    unfinished, kept = _cut_short(r) if r.stopped else ((), {})
    r.engine.keep_state(r.device)
    rep = report(r, t_decode)
    if stats is not None:
        stats.update(rep)
    return Result(r.results, unfinished, kept, r.masks, r.ends, rep)


def _cut_short(r: Rollout) -> tuple[tuple, dict]:
    """After a stop: what is live keeps its tokens so far (and with `keep_kv` its pages),
    a multi-turn sample waiting on its environment its tokens so far (observations in) and
    its mask, its pages released; what waits for a slot has none. -> (the (p, g) cut short,
    sorted; kept handles by (p, g))."""
    e, kept = r.engine, {}
    live = [s for s, slot in enumerate(r.slots) if slot.sample is not None]
    stopped_pg = [r.slots[s].sample for s in live] + turns.cut_short(r)
    for s in live:
        finished(r, r.slots[s], "cut", finished=False)
    if live and r.request.keep_kv:
        # cached: the prompt and every sampled token but the last, the next one fed
        r.device, handles = e.keep(
            r.device, live, [r.slots[s].cached for s in live],
            [np.concatenate([r.prompts[p], r.results[p][g][0]])[-1]
             for p, g in stopped_pg[:len(live)]],
            [r.slots[s].rope_delta for s in live])
        kept.update(zip(stopped_pg, handles))
        r.st["kept"] += len(live)
    elif live:
        r.device = e.free(r.device, live)
    for s in live:
        r.slots[s] = Slot()
    r.admitted.clear()
    if r.request.keep_kv:   # kept samples that did not get a slot stay kept
        kept.update(((p, 0), k) for p, k in r.resume.items())
    else:
        e.release_kept(r.resume.values())
    r.resume.clear()
    for pre in r.open_prefix.values():
        e.release(pre)
    r.open_prefix.clear()
    waiting = list(r.redo) + [(p, g) for p in r.queue
                              for g in range(r.next_sample[p], r.counts[p])]
    for p, g in waiting:
        r.results[p][g] = (np.zeros(0, np.int32), np.zeros(0, np.float32))
        r.masks[p][g], r.ends[p][g] = np.zeros(0, np.int8), "cut"
    return tuple(sorted(stopped_pg + waiting)), kept
