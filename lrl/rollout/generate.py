"""`generate`: sample completions for a list of prompts with continuous batching.

    outs = lrl.rollout.generate(cfg, params, prompts, max_new_tokens=256, num_samples=8,
                                temperature=1.0, eos_ids=cfg.eos_token_ids, seed=0)
    tokens, logps = outs[prompt_index][sample_index]

Prompts are admitted in order: a prompt is prefilled once, when its first sample gets a slot,
and its samples then take free slots as they appear, all reading the prompt's pages. Between
decode calls the host collects finished slots (end token or length limit), returns their
pages and refills them from the waiting samples; once no sample waits, it collects each call
while the next one runs. Sample g of prompt p draws its tokens with
keys derived from (seed, p * num_samples + g, step), whatever slot it lands in.

Multimodal prompts pass `prompt_embeds` (per prompt [T', D], T' >= T, visual rows spliced
in) and `prompt_positions` (per prompt [3, T] M-RoPE positions); the prefill reads them once
per prompt and its G samples decode at rotary position `index + rope delta`.

P prompts · G samples per prompt · B batch rows: the engine's slots · T query positions ·
D model width.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from lrl.models.config import ModelConfig
from lrl.rollout.engine import Engine, EngineConfig, k_splits
from lrl.rollout.pages import num_pages_for_memory, num_pages_for_tokens, pages_for
from lrl.rollout.paged_kernel import kv_heads_per_program
from lrl.rollout.sampling import SamplingParams
from lrl.rollout.steps import whole_prefill_lengths


# Decode steps a call runs (fewer once no slot is live): a finished slot waits for the call's
# end to be refilled, and each call costs the host a collection.
STEPS_PER_CALL = 16


def _check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
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


def _pool_pages(cfg, prompts, max_new, page_size, slots, pool_tokens, pool_fraction, mesh):
    if pool_tokens is not None:
        return num_pages_for_tokens(pool_tokens, page_size)
    if pool_fraction is not None:
        tensor = mesh.shape["tensor"] if mesh is not None else 1
        shards = tensor if cfg.n_kv_heads % tensor == 0 else 1
        return num_pages_for_memory(cfg, page_size, pool_fraction, kv_shards=shards)
    # Default: room for every prompt's pages and `slots` samples at once (a sample owns at
    # most its new tokens' pages plus the copy of its prompt's partial page).
    prompt_pages = sum(pages_for(len(p) - 1, page_size) for p in prompts)
    return prompt_pages + slots * (pages_for(max_new, page_size) + 1) + 1


def engine_config(cfg: ModelConfig, *, max_prompt_len: int, max_new_tokens: int,
                  max_slots: int, num_pages: int, page_size: int = 16,
                  prefill_chunk: Optional[int] = None, prefill_tokens: int = 16384,
                  max_prompts: Optional[int] = None, eos_ids: Sequence[int] = (),
                  sampling: SamplingParams = SamplingParams(),
                  attention_impl: Optional[str] = None, decode_block_pages: int = 4,
                  prefill_block_pages: Optional[int] = None,
                  pallas_k_splits: Optional[int] = None, pallas_warps: int = 4,
                  pallas_stages: int = 1, pallas_kv_per_program: int = 1,
                  layer_unroll: int = 1, fused_decode: bool = False,
                  sampling_impl: Optional[str] = None,
                  narrow_widths: Optional[Sequence[int]] = None,
                  resumed_prompts: bool = False, whole_prefill: bool = True) -> EngineConfig:
    """An engine's configuration from the sizes it must serve: prompts of at most
    `max_prompt_len` tokens with `max_new_tokens` more, `max_slots` decode rows, a pool of
    `num_pages`. A prefill call is [R, C]: C = `prefill_chunk` (None: the longest prompt's
    cached tokens, a power of two from 16 to 4096), R = `prefill_tokens` // C, and no more
    rows than `max_prompts` prompts fill (when given); calls that fill an eighth of R or less
    take R/8 rows; where C is 4x or more the longest prompt (`resumed_prompts`), a few fresh
    prompts go in calls [1, S], S the longest prompt's tokens as a power of two.
    `narrow_widths` (None: a quarter of the slots, a sixteenth, ..., down to 16 rows) are the
    tail's narrower decode calls.
    `resumed_prompts`: a prompt may come back with its sample's tokens so far (partial
    rollouts), up to `max_prompt_len + max_new_tokens - 1` tokens, and C is sized for that: a
    carried sample in one packed row, not chunk after chunk through the paged path
    (re-prefill was 1.4 s of a 5.5 s step in chunks of 256, docs/benchmark-history.md, "Eleventh
    session"). `whole_prefill`: a prompt longer than C goes in one whole-prompt call, of one
    of a few lengths up to `prefill_tokens` (`whole_prefill_lengths`), not chunk after chunk
    of C through the paged path; False: chunks."""
    longest = max_prompt_len + (max_new_tokens - 1 if resumed_prompts else 0)
    # A prompt of n tokens prefills n - 1: a power of two that holds them, 16 at least.
    chunk_for = lambda n: max(16, 1 << max(0, n - 2).bit_length())  # noqa: E731
    if prefill_chunk is None:
        prefill_chunk = min(4096, chunk_for(longest))
    rows = max(1, prefill_tokens // prefill_chunk)
    if max_prompts is not None:
        rows = min(rows, 1 << max(0, max_prompts - 1).bit_length())
    if prefill_block_pages is None:
        prefill_block_pages = max(1, 1024 // page_size)
    # Fresh prompts' own chunk, where C is sized for much longer (resumed) ones.
    short = chunk_for(max_prompt_len)
    return EngineConfig(
        page_size=page_size, num_pages=num_pages, max_slots=max_slots,
        max_pages_per_slot=pages_for(max_prompt_len + max_new_tokens - 1, page_size),
        prefill_chunk=prefill_chunk, prefill_rows=rows,
        prefill_narrow_rows=rows // 8 if rows >= 8 else 0,
        prefill_short_chunk=short if 4 * short <= prefill_chunk else 0,
        prefill_batch_tokens=rows * prefill_chunk,
        prefill_lengths=(whole_prefill_lengths(prefill_chunk, longest - 1, prefill_tokens)
                         if whole_prefill else ()),
        eos_ids=tuple(int(e) for e in eos_ids),
        sampling=sampling, attention_impl=attention_impl,
        decode_block_pages=decode_block_pages, prefill_block_pages=prefill_block_pages,
        layer_unroll=layer_unroll,
        pallas_k_splits=pallas_k_splits or k_splits(
            max_slots, cfg.n_kv_heads // kv_heads_per_program(
                cfg.n_heads, cfg.n_kv_heads, pallas_kv_per_program),
            row_tokens=max_prompt_len + max_new_tokens - 1),
        pallas_warps=pallas_warps, pallas_stages=pallas_stages,
        pallas_kv_per_program=pallas_kv_per_program, fused_decode=fused_decode,
        sampling_impl=sampling_impl,
        narrow_widths=tuple(sorted(set(narrow_widths))) if narrow_widths is not None
        else _tail_widths(max_slots))


def _tail_widths(slots: int, smallest: int = 16) -> tuple[int, ...]:
    """A quarter of the slots, a sixteenth, ..., while at least `smallest` rows: each width is
    one more compiled decode program, used once at most that many slots are live."""
    widths, w = [], slots // 4
    while w >= smallest:
        widths.append(w)
        w //= 4
    return tuple(sorted(widths))


def generate(cfg: ModelConfig, params, prompts: Sequence, *, max_new_tokens: int,
             num_samples: int = 1, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_ids: Sequence[int] = (), seed: int = 0, page_size: int = 16,
             max_slots: Optional[int] = None, pool_tokens: Optional[int] = None,
             pool_fraction: Optional[float] = None, prefill_chunk: Optional[int] = None,
             prefill_batch_tokens: int = 16384, whole_prefill: bool = True,
             steps_per_call: int = STEPS_PER_CALL, attention_impl: Optional[str] = None,
             decode_block_pages: int = 4, prefill_block_pages: Optional[int] = None,
             pallas_k_splits: Optional[int] = None, pallas_warps: int = 4,
             pallas_stages: int = 1, pallas_kv_per_program: int = 1, layer_unroll: int = 1,
             fused_decode: bool = False, sampling_impl: Optional[str] = None,
             mesh=None, stats: Optional[dict] = None,
             prompt_embeds: Optional[Sequence] = None,
             prompt_positions: Optional[Sequence] = None,
             prefill_fn: Optional[Callable] = None, engine: Optional[Engine] = None,
             decode_params=None, max_new_fn: Optional[Callable[[int], int]] = None,
             reserve_pages: bool = False, samples_per_prompt: Optional[Sequence[int]] = None,
             max_new_per_prompt: Optional[Sequence[int]] = None,
             stop_fn: Optional[Callable[[list, int], bool]] = None,
             unfinished: Optional[list] = None, stop_below: int = 0,
             narrow_widths: Optional[Sequence[int]] = None, kept: Optional[Sequence] = None,
             kept_out: Optional[dict] = None, overlap_admission: bool = False):
    """-> [P][G] list of (token ids int32, log-probs float32) per sample.

    Partial rollouts (`lrl.rollout.partial`): `samples_per_prompt` gives each prompt its own
    sample count (else `num_samples` each; sample ids then run on over the prompts in order)
    and `max_new_per_prompt` its own limit (at most `max_new_tokens`), so a sample carried
    from an earlier rollout comes back as a prompt of its own: its prompt and tokens so far,
    re-prefilled, one sample, the tokens it has left. `stop_fn(finished, sampled) -> bool` is
    asked after every collected decode call, with the (p, g) samples that call finished and
    the tokens sampled so far; True stops the rollout there: a live sample returns what it
    sampled, a waiting one nothing, and each is appended, as (p, g), to `unfinished` (a list).
    `stop_below` (with `stop_fn`): also stop once no sample waits and fewer than that many
    slots are live, the rollout's tail, where decode steps cost nearly as much for few rows.
    With `kept_out` (a dict) and a run's `engine`, a stopped rollout leaves each live sample's
    pages in the pool: `kept_out[(p, g)]` is its `Kept` handle, and `kept[p]` (a handle or None per
    prompt, a prompt of one sample: its prompt and tokens so far, as above) resumes it in a
    slot without a prefill. A handle the engine no longer holds is prefilled, and when pages
    run short, kept samples' pages go (prefilled later) before a live sample is preempted or
    admission waits; a kept sample still waiting when the rollout stops stays kept.

    `engine`: an engine built once for many calls (`engine_config`): its compiled programs and
    its pool are reused, and the size arguments here (pool, slots, pages, prefill and kernel
    launch settings) are its own; `decode_params` are the weights already in its decode layout
    (`lrl.rollout.weights.DecodeWeights`), else they are relaid here. Without an engine one is
    built for this call, sized for these prompts. `max_new_fn(sample_id) -> n` (benchmarks
    only) stops sample p * G + g after n <= max_new_tokens tokens, as if its end token came.

    `narrow_widths` (None: `engine_config`'s) are the narrower decode calls of the tail: once
    no sample waits and at most W slots are live, a call computes W rows, not all the slots.
    Once no sample waits, the next decode call is launched before the last one is collected,
    so the device does not idle while the host reads tokens back and grows pages;
    `overlap_admission` does so while samples wait too: the slots a call frees are then
    refilled a call later (their rows idle through one more call), and the host's collection,
    admission and page growth, which otherwise leave the device idle between calls, run while
    it decodes.

    A slot's pages grow with its sample, a decode call's worth ahead of it; when the pool
    runs short, the youngest samples are preempted (their pages freed) and run again from
    their start later, drawing the same tokens (their keys are per sample and step).
    `reserve_pages` gives each sample all it may write at admission instead: fewer samples
    fit at once, none is preempted.

    The pool holds `pool_tokens` tokens, or `pool_fraction` of free device memory, or by
    default enough for all prompts plus `max_slots` samples. `stats`, when a dict, is filled
    with timings and counts (prefill_s, decode_s, decode_steps, new_tokens, sampled_tokens
    (preempted ones included), occupancy, slot_occupancy, kv_token_steps,
    peak_pages, pages_allocated, pages_unshared, ...) and blocks on a prefill to time it when
    no decode call is in flight (one launched behind a decode call counts in decode_s: the
    wall time from the first decode call to the last collection, less the prefills timed).
    `pallas_k_splits` (None: from the slot count and the longest row, `k_splits`) splits each
    row's pages over that many programs of the GPU attention kernel, so a few long rows
    still fill the GPU and no program streams a whole long row alone;
    `pallas_warps` / `pallas_stages` are that kernel's Triton num_warps and num_stages;
    `pallas_kv_per_program`, for attention_impl="pallas_gqa", the kv heads one program takes;
    `fused_decode` lets that kernel also add the qkv bias, apply q/k norm and RoPE and write
    the new token's key and value (EngineConfig.fused_decode; off, slower on the H200).
    `sampling_impl` (None: our Pallas kernel where attention uses one, else XLA) takes the
    blocks' masses for temperature sampling (EngineConfig.sampling_impl).
    A prefill call is [R, C]: C = `prefill_chunk` tokens a row (None: the longest prompt's, a
    power of two up to 4096), R rows within `prefill_batch_tokens` (and the prompts' count);
    short prompts share rows, a longer one goes in one whole-prompt call (`whole_prefill`,
    `engine_config`), or C tokens at a time.
    `prefill_fn(engine, params, state, prefixes) -> state` replaces `engine.run_prefill`, e.g.
    `lrl.rollout.sp_prefill.make_prefill(mesh)` for long prompts prefilled over `seq`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    prompts = _check_prompts(prompts, cfg.vocab_size)
    P, G = len(prompts), num_samples
    counts = [G] * P if samples_per_prompt is None else [int(n) for n in samples_per_prompt]
    max_new = ([max_new_tokens] * P if max_new_per_prompt is None
               else [int(n) for n in max_new_per_prompt])
    if len(counts) != P or len(max_new) != P:
        raise ValueError(f"generate: {P} prompts but {len(counts)} samples_per_prompt and "
                         f"{len(max_new)} max_new_per_prompt")
    if min(counts, default=1) < 1 or not all(1 <= n <= max_new_tokens for n in max_new):
        raise ValueError(f"generate: samples_per_prompt must be >= 1 and max_new_per_prompt in "
                         f"[1, {max_new_tokens}]: {counts}, {max_new}")
    first_id = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int) if P else []
    if (prompt_embeds is None) != (prompt_positions is None):
        raise ValueError("generate: multimodal prompts need both prompt_embeds and "
                         "prompt_positions")
    if prompt_embeds is not None and not len(prompt_embeds) == len(prompt_positions) == P:
        raise ValueError(f"generate: {P} prompts but {len(prompt_embeds)} prompt_embeds and "
                         f"{len(prompt_positions)} prompt_positions")
    if P == 0:
        return []
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    eos = tuple(int(e) for e in eos_ids)
    if engine is None:   # built for this call: nothing outlives it
        kept_out = None
        B = max_slots or min(P * G, 256)
        longest = max(len(p) for p in prompts)
        ecfg = engine_config(
            cfg, max_prompt_len=longest, max_new_tokens=max_new_tokens, max_slots=B,
            num_pages=_pool_pages(cfg, prompts, max_new_tokens, page_size, B, pool_tokens,
                                  pool_fraction, mesh),
            page_size=page_size, prefill_chunk=prefill_chunk, prefill_tokens=prefill_batch_tokens,
            whole_prefill=whole_prefill, max_prompts=P, eos_ids=eos, sampling=sampling,
            attention_impl=attention_impl,
            decode_block_pages=decode_block_pages, prefill_block_pages=prefill_block_pages,
            layer_unroll=layer_unroll, pallas_k_splits=pallas_k_splits,
            pallas_warps=pallas_warps, pallas_stages=pallas_stages,
            pallas_kv_per_program=pallas_kv_per_program, fused_decode=fused_decode,
            sampling_impl=sampling_impl, narrow_widths=narrow_widths)
        engine = Engine(cfg, ecfg, mesh)
    B = engine.ecfg.max_slots
    for i, p in enumerate(prompts):
        engine.check_fits(len(p), max_new[i], what=f"prompt {i}")
    resume = {}   # prompt -> the kept sample it resumes, while it waits
    for p, k in enumerate(kept or ()):
        if k is None or not engine.holds(k):
            engine.release_kept([k])   # another engine's: prefilled here
            continue
        if counts[p] != 1 or k.length != len(prompts[p]) - 1 or k.token != prompts[p][-1]:
            raise ValueError(f"generate: prompt {p} ({len(prompts[p])} tokens, "
                             f"{counts[p]} samples) is not its kept sample's ({k.length} "
                             f"tokens cached, next token {k.token})")
        resume[p] = k
    state = engine.take_state()
    if decode_params is None:
        decode_params = engine.decode_params(params)
    dparams = decode_params
    rng = jax.random.key(seed)
    results = [[None] * n for n in counts]
    queue = collections.deque(range(P))   # prompts with samples not yet admitted
    redo = collections.deque()            # (p, g) samples preempted, to run again from start
    next_sample = [0] * P
    open_prefix = {}
    free_slots = collections.deque(range(B))
    owner: list[Optional[tuple[int, int]]] = [None] * B
    limit = [0] * B        # tokens the slot's sample samples at most
    done_len = [0] * B     # cache positions the slot has filled, as collected
    admitted = []          # owned slots, oldest first: the youngest is preempted first
    out_tokens: dict[int, list] = {}
    out_logps: dict[int, list] = {}
    st = collections.Counter()
    # decode_s: the wall time from the first decode call's launch to the last collection,
    # less the prefills timed alone in it; so it holds the host's work between calls too.
    t_prefill = t_prefill_decoding = 0.0
    t_decode0 = None
    prefilled = []         # the prompts prefilled, once for each prefix
    rope_delta = [0] * B
    since = [0] * B        # the first decode call a slot's sample is in (calls numbered from 0)
    launched = 0           # decode calls launched so far
    # Pages grow with the samples (a call's worth ahead) unless `reserve_pages`, in which case
    # each sample holds all it may write from the start: fewer samples fit, none is preempted.
    grow = not reserve_pages

    def collect(state, call):
        """Appends a decode call's tokens to their samples; frees the slots that finished. A
        slot filled after the call was launched (`overlap_admission`) is not in it."""
        out, width, launched = call
        # Only transfers here: a jax op on `out` would queue behind the call in flight.
        tokens, logps, valid, active = jax.device_get(
            (out.tokens, out.logps, out.valid, out.active))
        t_got = time.perf_counter()
        tokens, logps, valid = tokens.T, logps.T, valid.T
        done = []
        for s in range(B):
            if owner[s] is None or since[s] > launched:
                continue
            v = valid[s]
            before = sum(len(c) for c in out_tokens[s])
            out_tokens[s].append(tokens[s, v])
            out_logps[s].append(logps[s, v])
            n = len(out_tokens[s][-1])
            done_len[s] += n
            T = len(prompts[owner[s][0]])
            # kv tokens read by this slot's steps: T + before, ..., T + before + n - 1
            st["kv_token_steps"] += n * (T + before) + n * (n - 1) // 2
            if not active[s]:
                p, g = owner[s]
                finished_now.append((p, g))
                results[p][g] = (np.concatenate(out_tokens.pop(s)).astype(np.int32),
                                 np.concatenate(out_logps.pop(s)).astype(np.float32))
                st["new_tokens"] += len(results[p][g][0])
                owner[s] = None
                admitted.remove(s)
                done.append(s)
        steps_run = int(valid.any(axis=0).sum())
        st["decode_steps"] += steps_run
        st["computed_rows"] += steps_run * width   # rows the steps computed, idle ones included
        st["sampled_tokens"] += int(valid.sum())
        if done:
            state = engine.free(state, done)
            free_slots.extend(done)
        st["host_collect_s"] += time.perf_counter() - t_got
        return state

    def preempt(state, s):
        """Stops slot s's sample and queues it to run again from its start: its draws are keyed
        by (sample, step), so it samples the same tokens again."""
        st["preempted"] += 1
        st["preempted_tokens"] += sum(len(c) for c in out_tokens.pop(s))
        out_logps.pop(s)
        redo.appendleft(owner[s])
        owner[s] = None
        admitted.remove(s)
        free_slots.append(s)
        return engine.free(state, [s])

    limits: dict[int, int] = {}

    def limit_for(p: int, sample_id: int) -> int:
        """Tokens a sample samples at most (the same if it is preempted and run again)."""
        if sample_id not in limits:
            limits[sample_id] = (max_new[p] if max_new_fn is None else
                                 max(1, min(max_new[p], int(max_new_fn(sample_id)))))
        return limits[sample_id]

    def prefix_for(p):
        if p not in open_prefix:
            open_prefix[p] = engine.reserve_prefix(
                prompts[p], *((prompt_embeds[p], prompt_positions[p])
                              if prompt_embeds is not None else ()))
            st["prompt_pages"] += len(open_prefix[p].pages)
            st["prefill_tokens"] += len(prompts[p]) - 1
            prefilled.append(p)
            return open_prefix[p], True
        return open_prefix[p], False

    def reclaim(need: int) -> bool:
        """Releases kept samples' pages until `need` pages are free: first those this rollout
        does not resume, then its own, the last in line first (they are prefilled instead).
        -> whether `need` pages are free."""
        while engine.pool.num_free < need:
            ours = {id(k) for k in resume.values()}
            others = [k for k in engine.kept.values() if id(k) not in ours]
            if others:
                victim = others[0]
            elif resume:
                victim = resume.pop(max(resume))
            else:
                return False
            engine.release_kept([victim])
            st["kept_released"] += 1
        return True

    in_flight = None   # a decode call's output not yet collected (only once no prompt waits)
    finished_now: list = []   # (p, g) finished since stop_fn was last asked
    stopped = False
    while queue or redo or any(o is not None for o in owner):
        # Admission: fill free slots from the waiting samples while pages allow (keeping
        # what the live slots need to grow through the next two calls).
        new_prefixes, plans, finished_prefixes = [], [], []
        t_admit = time.perf_counter()
        keep = sum(engine.pages_short(s, done_len[s] + 2 * steps_per_call + 1)
                   for s in admitted) if grow else 0
        while free_slots and (redo or queue):
            if redo:   # a prefix of its own unless its prompt still admits samples
                p, g = redo[0]
                last = not (queue and queue[0] == p)
            else:
                p = queue[0]
                g, last = next_sample[p], next_sample[p] == counts[p] - 1
            T = len(prompts[p])
            sid = int(first_id[p]) + g
            n = limit_for(p, sid)
            first = min(steps_per_call, n) if grow else None
            k = None if redo else resume.get(p)
            if k is not None:
                need = engine.resume_pages(k, n if first is None else first)
            else:
                need = engine.sample_pages(T, n if first is None else first)
                if p not in open_prefix:
                    need += engine.prefix_pages(T)
            if engine.pool.num_free - keep < need:
                if reclaim(keep + need):
                    continue   # with the head's own kept pages gone, its need is counted anew
                break
            slot = free_slots.popleft()
            if k is not None:
                del resume[p]
                plan = engine.resume_slot(k, slot, sid, max_new[p], first_tokens=first)
                st["kept_resumed"] += 1
            else:
                pre, new = prefix_for(p)
                if new:
                    new_prefixes.append(pre)
                plan = engine.reserve_slot(pre, slot, sid, max_new[p], last=last,
                                           first_tokens=first)
            if n < max_new[p]:   # a forced length (benchmarks): it stops early
                plan = dataclasses.replace(plan, remaining=n)
            plans.append(plan)
            owner[slot], out_tokens[slot], out_logps[slot] = (p, g), [], []
            limit[slot], done_len[slot], rope_delta[slot] = n, T - 1, plan.rope_delta
            since[slot] = launched
            admitted.append(slot)
            if grow:
                keep += engine.pages_short(slot, min(T - 1 + 2 * steps_per_call + 1, T - 1 + n))
            if redo:
                redo.popleft()
            else:
                next_sample[p] += 1
                if next_sample[p] == counts[p]:
                    queue.popleft()
            if last and p in open_prefix:
                finished_prefixes.append(open_prefix.pop(p))
        st["peak_pages"] = max(st["peak_pages"], engine.pool.num_used)
        st["host_admit_s"] += time.perf_counter() - t_admit
        if new_prefixes:
            t0 = time.perf_counter()
            # Prefill reads the decode layout too: no layer sliced out of a stack per call,
            # joined qkv and gate/up matmuls, compute-dtype weights.
            state = (engine.run_prefill(dparams, state, new_prefixes) if prefill_fn is None
                     else prefill_fn(engine, params, state, new_prefixes))
            if stats is not None:
                st["prefill_rounds"] += 1   # admissions that prefilled
                # Timed alone only with no decode call in flight (waiting on it would end the
                # overlap); else it is in decode_s, as what the device ran between calls.
                if in_flight is None:
                    jax.block_until_ready(state.k_pages)
                    dt = time.perf_counter() - t0
                    t_prefill += dt
                    if t_decode0 is not None:
                        t_prefill_decoding += dt
        if plans:
            state = engine.run_insert(state, plans)
        for pre in finished_prefixes:   # only now: its partial page has been copied
            engine.release(pre)
        if all(o is None for o in owner):
            raise RuntimeError("no sample could be admitted although the pool is empty; "
                               "this is a bug in the page accounting")

        t0 = time.perf_counter()
        if grow:   # pages for every token the next call (and the one in flight) may write
            ahead = steps_per_call * (2 if in_flight is not None else 1)
            want = {s: min(done_len[s] + ahead, len(prompts[owner[s][0]]) - 1 + limit[s])
                    for s in admitted}
            short = sum(engine.pages_short(s, n) for s, n in want.items())
            reclaim(short)
            if short > engine.pool.num_free:
                if in_flight is not None:   # preempt only what is collected
                    state, in_flight = collect(state, in_flight), None
                    want = {s: min(done_len[s] + steps_per_call,
                                   len(prompts[owner[s][0]]) - 1 + limit[s]) for s in admitted}
                while sum(engine.pages_short(s, n) for s, n in want.items()) > \
                        engine.pool.num_free:
                    victim = admitted[-1]
                    state = preempt(state, victim)
                    want.pop(victim)
            changed = [engine.grow(s, n) for s, n in want.items()]
            if any(changed):
                state = engine.with_page_table(state)
        st["host_grow_s"] += time.perf_counter() - t0
        # Decode until a slot may have finished. Once no sample waits (or always, with
        # `overlap_admission`), launch the next call first and collect the previous one while
        # it runs, so the device does not idle while the host reads tokens back; else collect
        # this call at once, so that its freed slots are refilled before the next call. With
        # the decode loop's condition on the device (`steps._DECODE_OPTIONS`), steps were
        # faster than when every call was collected before the next was launched
        # (docs/benchmark-history.md, "Sixth session", "Overlap").
        # With no sample waiting, no slot fills before the next call: a call computes only the
        # live rows (a narrower program, `EngineConfig.narrow_widths`) once they fit one.
        rows = None if queue or redo else sorted(admitted)
        width = engine.width_for(len(rows)) if rows is not None else B
        if t_decode0 is None:
            t_decode0 = time.perf_counter()
        state, out = engine.generate(dparams, state, rng, num_steps=steps_per_call,
                                     sampling=sampling, eos_ids=eos, rows=rows)
        # Its copies back are queued now, behind this call alone: asked for only at the
        # collection, after the next call's launch, they may wait for that call too. An H200
        # trace showed the device idle between decode calls, 0.25 s of a 1.5 s rollout, as
        # if the host admitted each call's samples only after the next call had run
        # (docs/benchmark-history.md, "Seventeenth session"); whether this closes it is not measured.
        for x in (out.tokens, out.logps, out.valid, out.active):
            x.copy_to_host_async()
        out, launched = (out, width, launched), launched + 1
        st["decode_calls"] += 1
        st["narrow_calls"] += width < B
        st["live_slots_at_calls"] += len(admitted)
        if (queue or redo) and not overlap_admission:
            if in_flight is not None:
                state, in_flight = collect(state, in_flight), None
            state = collect(state, out)
        else:
            if in_flight is not None:
                state = collect(state, in_flight)
            in_flight = out
        if stop_fn is not None:
            done_now, finished_now[:] = list(finished_now), []
            tail = stop_below and not (queue or redo) and len(admitted) < stop_below
            if stop_fn(done_now, st["sampled_tokens"]) or tail:
                stopped = True
                st["stopped_in_tail"] = int(bool(tail))
                break

    if in_flight is not None:   # the last call: nothing if every slot had finished before
        state = collect(state, in_flight)   # it, else (a stop) its tokens are the samples' too
    t_decode = (0.0 if t_decode0 is None else
                time.perf_counter() - t_decode0 - t_prefill_decoding)
    if stopped:   # what is live keeps its tokens so far; what waits has none
        live = [s for s in range(B) if owner[s] is not None]
        stopped_pg = [owner[s] for s in live]
        for s in live:
            p, g = owner[s]
            results[p][g] = (np.concatenate(out_tokens.pop(s) or [np.zeros(0)]).astype(np.int32),
                             np.concatenate(out_logps.pop(s) or [np.zeros(0)]).astype(np.float32))
            st["new_tokens"] += len(results[p][g][0])
            owner[s] = None
        if live and kept_out is not None:
            # cached: the prompt and every sampled token but the last, the next one fed
            state, handles = engine.keep(
                state, live, [done_len[s] for s in live],
                [np.concatenate([prompts[p], results[p][g][0]])[-1] for p, g in stopped_pg],
                [rope_delta[s] for s in live])
            kept_out.update(zip(stopped_pg, handles))
            st["kept"] += len(live)
        elif live:
            state = engine.free(state, live)
        if kept_out is not None:   # kept samples that did not get a slot stay kept
            kept_out.update(((p, 0), k) for p, k in resume.items())
        else:
            engine.release_kept(resume.values())
        resume.clear()
        for pre in open_prefix.values():
            engine.release(pre)
        open_prefix.clear()
        waiting = list(redo) + [(p, g) for p in queue for g in range(next_sample[p], counts[p])]
        for p, g in waiting:
            results[p][g] = (np.zeros(0, np.int32), np.zeros(0, np.float32))
        if unfinished is not None:
            unfinished.extend(sorted(stopped_pg + waiting))
    engine.keep_state(state)   # raises if a page not kept is still in use
    if stats is not None:
        page_size = engine.ecfg.page_size
        stats.update(dict(st), prefill_s=t_prefill, decode_s=t_decode, prefilled=prefilled,
                     num_pages=engine.ecfg.num_pages, slots=B,
                     # the share of decode-step rows that sampled a token
                     occupancy=st["new_tokens"] / max(1, st["decode_steps"] * B),
                     # the share of decode-step rows live, what preemption then threw away
                     # included: the slot occupancy over the rollout
                     slot_occupancy=st["sampled_tokens"] / max(1, st["decode_steps"] * B),
                     # the share of the rows the decode steps computed that sampled a token
                     # (narrow tail calls compute fewer rows than the slots)
                     row_occupancy=st["sampled_tokens"] / max(1, st["computed_rows"]),
                     attention_impl=engine.ecfg.attention_impl,
                     attention_fallback=engine.fallback,
                     sampling_impl=engine.ecfg.sampling_impl,
                     pages_allocated=engine.pool.allocated_total,
                     pages_unshared=sum(n * pages_for(len(p) + m - 1, page_size)
                                        for p, n, m in zip(prompts, counts, max_new)),
                     prefill_tokens_unshared=sum(n * (len(p) - 1)
                                                 for p, n in zip(prompts, counts)))
    return results
