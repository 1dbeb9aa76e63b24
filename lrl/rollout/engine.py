"""The rollout engine: prefill, insert, generate and free over a paged KV cache, with the shape
of JetStream's Engine API, on the training model's own parameter arrays.

Device state is one pytree (`DecodeState`); every device step is a module-level pure function
in `lrl.rollout.steps`, jitted once per shape bucket. Host state (which pages and slots are in
use) lives in the `Engine` object here, in plain Python and numpy.

How a prompt of T tokens becomes G samples:
- `prefill` writes the KV of its first T - 1 tokens into fresh pages, in calls of one shape
  [R, C]: short prompts share rows; a longer one goes in one whole-prompt call [1, L] (L one
  of a few lengths, `EngineConfig.prefill_lengths`), or, longer than those, in chunks of C
  that attend to the pages already written (`run_prefill`). The last prompt
  token is left for the first decode step, so every sampled token, the first included, comes
  out of the same decode step with its log-prob.
- `insert` gives each of the G slots the prompt's full pages (shared, reference counted), its
  own copy of the partly filled last page (the prompt's last sample takes the page itself),
  and fresh pages for its first tokens (`reserve_slot`'s `first_tokens`; without it, for
  everything it may generate).
- `generate` runs decode steps for all live slots at once (or for the live rows only, a
  narrower program, `rows`); a slot stops by itself on an end token or its length limit.
  Between calls the host `grow`s each slot's pages a call's worth ahead of it
  (`with_page_table` hands the device the new rows), and `free` returns a slot's pages.
  When the pool runs short the scheduler frees the youngest samples' slots (preemption):
  they run again from their start later and draw the same tokens (keys per sample and step).
  All of that policy is the scheduler's (`lrl.rollout.scheduler`); the engine holds pages
  and slots and runs the device steps. Reserving every page at insert (`Policy.reserve_pages`)
  fits fewer samples at once and preempts none.
- A rollout stopped early (partial rollouts: the request's stop rule) may `keep` a live
  slot's sample instead of freeing it: its pages stay in the pool under a `Kept` handle, and
  a later rollout `resume_slot`s it, with no prefill; `release_kept` returns them (the sample
  is then prefilled again); the scheduler releases kept pages before it preempts a sample.

Multimodal prompts (optional): a prefix may carry its input embeddings [T, D] (visual rows
already spliced in, `lrl.models.vl.embed_tokens`) and M-RoPE positions [3, T]. Prefill then
feeds those embeddings with those rotary positions, and each slot keeps a rope delta: a decode
step at cache index `length` rotates by `length + rope_delta` (all three components equal,
since generated tokens are text). Text prompts have delta 0 and run exactly as before.

Weights: prefill takes the trainer's arrays as they are (it is compute-bound). Decoding reads
every weight every step, so `Engine.decode_params` relays them once per rollout
(`lrl.rollout.weights`: one array per layer, compute dtype, fsdp gathers dropped) and the
decode steps take that tree. With a mesh, the pool is split over kv heads on the `tensor`
axis and XLA partitions the steps.

B batch rows (a decode step's rows are the slots) · T query positions · C chunk ·
D model width · G samples per prompt.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lrl.models.config import ModelConfig
from lrl.models.flash import MAX_SEGMENTS
from lrl.rollout import paged_attention as pa
from lrl.rollout import paged_kernel
from lrl.rollout.pages import NULL_PAGE, PagePool, pages_for
# The device half; EngineConfig, DecodeState and StepOutput are re-exported from here.
from lrl.rollout.steps import (DecodeState, EngineConfig, StepOutput, _zero_state, deactivate,
                               decode_rows, decode_steps, insert_slots, prefill_chunk,
                               prefill_packed)
from lrl.rollout.weights import decode_params

__all__ = ["DecodeState", "Engine", "EngineConfig", "Extension", "Kept", "Prefix", "SlotPlan",
           "StepOutput"]


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt: its tokens and the pages holding the KV of all but its last token."""
    tokens: np.ndarray
    pages: list[int]          # full pages, then the partial one (if any)
    partial: bool             # whether the last of `pages` is only partly filled
    closed: bool = False      # its last sample has been reserved
    holds: list[int] = None   # pages this prefix still holds a reference to
    embeds: Optional[jax.Array] = None     # [T, D] input embeddings (multimodal prompts)
    positions: Optional[np.ndarray] = None  # [3, T] M-RoPE positions (multimodal prompts)

    def __post_init__(self):
        if self.holds is None:
            self.holds = list(self.pages)

    @property
    def rope_delta(self) -> int:
        """Rotary position minus cache index of the tokens after the prompt."""
        if self.positions is None:
            return 0
        return int(self.positions[0, -1]) - (len(self.tokens) - 1)

    @property
    def cached(self) -> int:
        return len(self.tokens) - 1

    @property
    def full_pages(self) -> list[int]:
        return self.pages[:-1] if self.partial else self.pages


@dataclasses.dataclass
class SlotPlan:
    slot: int
    prefix: Optional[Prefix]  # None: a kept sample resumed (`resume_slot`)
    sample_id: int
    max_new_tokens: int
    pages: list[int]          # the slot's whole page row (shared full pages first)
    copy_src: int             # the prompt's partial page, or the null page
    copy_dst: int
    length: int               # tokens in its cache
    token: int                # the first token it feeds
    rope_delta: int = 0
    remaining: Optional[int] = None   # tokens it samples at most (None: max_new_tokens)
    steps: int = 0            # tokens its sample sampled before (its draws go on from there)


@dataclasses.dataclass
class Extension:
    """Tokens to prefill into a slot's pages after the `start` cache positions they hold
    (`Engine.extend_slot`: a multi-turn sample's last token and observation)."""
    pages: list[int]
    start: int
    tokens: np.ndarray


# eq=False: a handle is one sample's, compared by identity.
@dataclasses.dataclass(eq=False)
class Kept:
    """A sample stopped with its KV left in `engine`'s pool (`Engine.keep`): its whole page
    row (the shared prompt pages it reads and its own), the tokens in its cache, the next
    token to feed, its rope delta. Valid while the engine holds it (`Engine.holds`): until it
    is resumed (`resume_slot`) or released (`release_kept`, or by the engine itself when a
    rollout runs short of pages)."""
    engine: "Engine"
    pages: list[int]
    length: int
    token: int
    rope_delta: int = 0


def k_splits(slots: int, kv_programs: int, row_tokens: int = 0, programs: int = 512,
             split_tokens: int = 1024, most: int = 64) -> int:
    """Kv splits of the decode kernel, a power of two: enough that slots x kv-head programs x
    splits make about `programs` (from 1 to 16 on that count), and, for rows of up to
    `row_tokens`, enough that one split streams at most about `split_tokens` of a row (up to
    `most`).

    The first rule fills the GPU: many slots fill it unsplit, and splitting them was slower
    (256 slots: 1 split faster than 2 or 4); a few long rows need the splits (16 rows of 8K
    tokens: 16 faster than 8). The second bounds the longest program. A program streams its
    pages one block after another, so a row of 16K tokens in one split of two was a serial
    read of 8K tokens that the short rows had long finished: long partial rollouts read KV at
    1.1-1.4 TB/s where uniform rows reach 2.5-3.2. The splits a short row does not reach are
    programs that find no page and end at once. Qwen2.5-1.5B shapes; docs/benchmark-history.md, "Decode
    layout of the weights", the fourth session's kernel table, "Measurements once quoted in
    the code" and "Thirteenth session"."""
    k = 1
    while k < 16 and slots * kv_programs * k < programs:
        k *= 2
    while k < most and row_tokens // (2 * k) >= split_tokens:
        k *= 2
    return k


# Prompts a packed prefill row may hold: cuDNN's packed layout takes MAX_SEGMENTS runs a row,
# and the row's padding is one of them.
_PROMPTS_PER_ROW = MAX_SEGMENTS - 1


def _first_fit(prefixes, C: int) -> list[list[Prefix]]:
    """Prefixes -> rows of at most C of their first tokens and `_PROMPTS_PER_ROW` of them, in
    admission order (first fit)."""
    rows, used = [], []
    for pre in prefixes:
        n = min(pre.cached, C)
        for r, u in enumerate(used):
            if u + n <= C and len(rows[r]) < _PROMPTS_PER_ROW:
                rows[r].append(pre)
                used[r] += n
                break
        else:
            rows.append([pre])
            used.append(n)
    return rows


@functools.partial(jax.jit, donate_argnums=0)
def _place(rows_RCD, emb_TD, r, at, start, n):
    """rows_RCD with row r's positions [at, at + n) set to emb_TD[start:start + n]: indices
    traced, so one program per buffer and table shape, not one per prompt length (eager
    slices, pads and concatenates compiled again for every new length)."""
    C, T = rows_RCD.shape[1], emb_TD.shape[0]
    j = jnp.arange(C)
    src = jnp.clip(j - at + start, 0, T - 1)
    row = jnp.where(((j >= at) & (j < at + n))[:, None],
                    jnp.take(emb_TD, src, axis=0).astype(rows_RCD.dtype), rows_RCD[r])
    return rows_RCD.at[r].set(row)


def embed_rows(R: int, C: int, D: int, dtype, pieces) -> jax.Array:
    """[R, C, D] prefill input embeddings, zero where no prompt is: `pieces` lists (row, at,
    embeds [T, D], start, n), each writing embeds[start:start + n] at [at, at + n) of its row.
    A prompt's embeddings may be longer than its tokens (`lrl.tasks.video` pads them to a
    bucket); only [start, start + n) is read."""
    out = jnp.zeros((R, C, D), dtype)
    for r, at, emb, start, n in pieces:
        out = _place(out, emb, np.int32(r), np.int32(at), np.int32(start), np.int32(n))
    return out


def _batches(rows: list, R: int) -> list[list]:
    return [rows[i:i + R] for i in range(0, len(rows), R)]


class Engine:
    """Host bookkeeping (page pool, slot rows) around the pure device steps of
    `lrl.rollout.steps`."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, mesh=None):
        self.cfg = cfg.replace(remat="none")
        impl = ecfg.attention_impl or pa.default_impl(mesh)
        kernel = impl.removesuffix("_interpret") in pa.PALLAS
        sampling = ecfg.sampling_impl or ("xla" if not kernel else
                                          "pallas_interpret" if impl.endswith("_interpret")
                                          else "pallas")
        self.ecfg = dataclasses.replace(ecfg, attention_impl=impl, sampling_impl=sampling)
        self.mesh = mesh
        self.pool = PagePool(ecfg.num_pages)
        self.slot_pages: list[Optional[list[int]]] = [None] * ecfg.max_slots
        self.kept: dict[int, Kept] = {}   # id -> the kept samples holding pages, oldest first
        self._pallas_ok = False
        self.fallback: Optional[str] = None
        self._state: Optional[DecodeState] = None
        self._made_state = False

    # ---- sizes
    def prefix_pages(self, prompt_len: int) -> int:
        return pages_for(prompt_len - 1, self.ecfg.page_size)

    def sample_pages(self, prompt_len: int, max_new_tokens: int) -> int:
        """Pages a sample owns: all it writes (T + max_new - 1 tokens) minus the shared ones."""
        ps = self.ecfg.page_size
        return pages_for(prompt_len + max_new_tokens - 1, ps) - (prompt_len - 1) // ps

    def check_fits(self, prompt_len: int, max_new_tokens: int, what: str = "prompt") -> None:
        ps, e = self.ecfg.page_size, self.ecfg
        total = prompt_len + max_new_tokens - 1
        if pages_for(total, ps) > e.pages_per_slot:
            raise ValueError(f"{what} of {prompt_len} tokens + {max_new_tokens} new needs "
                             f"{pages_for(total, ps)} pages per slot, the engine has "
                             f"{e.pages_per_slot} (max_pages_per_slot)")
        need = self.prefix_pages(prompt_len) + self.sample_pages(prompt_len, max_new_tokens)
        if need > self.pool.capacity:
            raise ValueError(f"{what} of {prompt_len} tokens + {max_new_tokens} new needs "
                             f"{need} pages of {ps} tokens, the whole pool has "
                             f"{self.pool.capacity}: raise pool_tokens / the memory fraction")

    # ---- state
    def init_decode_state(self) -> DecodeState:
        """Zeros, created in place: on one device (committed), or with the pool split over kv
        heads on the mesh's `tensor` axis and the slot arrays replicated."""
        if self.mesh is None:
            shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        else:
            tensor = self.mesh.shape["tensor"]
            split = tensor > 1 and self.cfg.n_kv_heads % tensor == 0
            kv = NamedSharding(self.mesh, PartitionSpec("tensor" if split else None))
            rep = NamedSharding(self.mesh, PartitionSpec())
            shardings = DecodeState(kv, kv, *[rep] * (len(DecodeState._fields) - 2))
        make = jax.jit(_zero_state, static_argnums=(0, 1), out_shardings=shardings)
        return make(self.cfg, self.ecfg)

    # ---- prefill
    def reserve_prefix(self, tokens, embeds=None, positions=None) -> Prefix:
        """Pages for a prompt; a multimodal one also gives its input embeddings [T', D]
        (T' >= T: rows past T, a length bucket's padding, are never read) and M-RoPE positions
        [3, T] (its last token must be text: it is decoded by token id)."""
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 1 or tokens.size < 1:
            raise ValueError(f"a prompt must be a non-empty 1-D token sequence, got shape "
                             f"{tokens.shape}")
        if (embeds is None) != (positions is None):
            raise ValueError("a multimodal prompt needs both embeds and positions")
        if embeds is not None:
            positions = np.asarray(positions, np.int32)
            T = tokens.size
            if (embeds.ndim != 2 or embeds.shape[0] < T or embeds.shape[1] != self.cfg.d_model
                    or positions.shape != (3, T)):
                raise ValueError(f"multimodal prompt of {T} tokens: embeds {embeds.shape} must "
                                 f"be ({T} or more, {self.cfg.d_model}), positions "
                                 f"{positions.shape} must be {(3, T)}")
            if len(set(positions[:, -1].tolist())) != 1:
                raise ValueError(f"multimodal prompt: its last token is not text (positions "
                                 f"{positions[:, -1].tolist()}); end prompts with a text token")
        n = tokens.size - 1
        return Prefix(tokens, self.pool.alloc(self.prefix_pages(tokens.size)),
                      partial=n % self.ecfg.page_size != 0, embeds=embeds, positions=positions)

    def page_row(self, pages) -> np.ndarray:
        """A slot's page-table row: `pages`, then the null page."""
        row = np.full(self.ecfg.pages_per_slot, NULL_PAGE, np.int32)
        row[:len(pages)] = pages
        return row

    def run_prefill(self, params, state: DecodeState, prefixes) -> DecodeState:
        """Fills the pages of `prefixes`: a prompt longer than C that one of
        `prefill_lengths` holds in a whole-prompt call of its own, [1, L] (`prefill_packed`
        over the whole prompt); the first C tokens of every other prompt packed first-fit
        into rows of C, each attending to itself (`prefill_packed`); then, for those longer
        than C, chunk after chunk of C tokens, one prompt a row, attending to the pages
        already written (`prefill_chunk`). Multimodal prompts (embeddings in, not ids) go in
        calls of their own. With `prefill_rows` set (an engine built for a run,
        `engine_config`) every packed call is [prefill_rows, prefill_chunk] (or
        [prefill_narrow_rows, C], or [1, prefill_short_chunk] a row for a few short text
        prompts), so no mix of prompt lengths compiles anew; without it a call is sized to its
        prompts (C a power of two up to prefill_chunk, R a power of two within
        prefill_batch_tokens)."""
        kp, vp = state.k_pages, state.v_pages
        todo = [p for p in prefixes if p.cached > 0]
        e = self.ecfg
        for multimodal in (False, True):
            group = [p for p in todo if (p.embeds is not None) == multimodal]
            if not group:
                continue
            C = e.prefill_chunk if e.prefill_rows else min(
                e.prefill_chunk, max(16, 1 << (max(p.cached for p in group) - 1).bit_length()))
            whole = [(p, e.whole_length(p.cached)) for p in group if p.cached > C]
            whole = [(p, L) for p, L in whole if L is not None]
            for pre, L in whole:
                kp, vp = self._packed_call(params, kp, vp, [[pre]], 1, L, multimodal)
            taken = {id(p) for p, _ in whole}
            group = [p for p in group if id(p) not in taken]
            if not group:
                continue
            rows = _first_fit(group, C)
            R = self._rows(C, len(rows), narrow=not multimodal)
            S = e.prefill_short_chunk
            if S and not multimodal and max(p.cached for p in group) <= S:
                short = _first_fit(group, S)
                if 2 * len(short) * S <= R * C:   # no prompt is longer than S: done here
                    for row in short:
                        kp, vp = self._packed_call(params, kp, vp, [row], 1, S, False)
                    continue
            for part in _batches(rows, R):
                kp, vp = self._packed_call(params, kp, vp, part, R, C, multimodal)
            for k in range(1, max(-(-p.cached // C) for p in group)):
                longer = [p for p in group if p.cached > k * C]
                R = self._rows(C, len(longer))
                for part in _batches(longer, R):
                    kp, vp = self._prefill_call(params, kp, vp, part, k * C, R, C)
        return state._replace(k_pages=kp, v_pages=vp)

    def _rows(self, C: int, needed: int, narrow: bool = False) -> int:
        e = self.ecfg
        if e.prefill_rows:
            if narrow and needed <= e.prefill_narrow_rows:
                return e.prefill_narrow_rows
            return e.prefill_rows
        return max(1, min(e.prefill_batch_tokens // C, 1 << max(0, needed - 1).bit_length()))

    def compile_prefill(self, params, state: DecodeState, multimodal: bool = False
                        ) -> DecodeState:
        """Runs the text prefill's fixed shapes once on empty rows (every token written to the
        null page), and the whole-prompt calls' [1, L] for the run's kind of prompt
        (`multimodal`: embeddings in), so that a run compiles them with its engine, not in
        whichever step first admits few prompts at a time, or a longer one. -> the state (its
        real pages untouched)."""
        e = self.ecfg
        kp, vp = state.k_pages, state.v_pages
        for R in sorted({e.prefill_rows, e.prefill_narrow_rows} - {0}):
            kp, vp = self._packed_call(params, kp, vp, [], R, e.prefill_chunk, False)
        if e.prefill_short_chunk:
            kp, vp = self._packed_call(params, kp, vp, [], 1, e.prefill_short_chunk, False)
        for L in e.prefill_lengths:
            kp, vp = self._packed_call(params, kp, vp, [], 1, L, multimodal)
        return state._replace(k_pages=kp, v_pages=vp)

    def compile_decode(self, params, state: DecodeState, num_steps: int) -> DecodeState:
        """Runs each decode program of the run once, all slots and each of `narrow_widths`, on
        a state with no live slot (its loop then runs no step), so that a run compiles them
        with its engine, not in whichever step first has few slots live (a partial rollout
        may go many steps before its first tail). -> the state."""
        if np.any(np.asarray(state.active)):
            raise ValueError("compile_decode: a slot is live; it runs on an idle state only")
        rng = jax.random.key(0)
        for width in (None,) + tuple(self.ecfg.narrow_widths):
            state, _ = self.generate(params, state, rng, num_steps=num_steps,
                                     rows=None if width is None else list(range(width)))
        return state

    def _packed_call(self, params, kp, vp, rows, R: int, C: int, multimodal: bool):
        """One `prefill_packed` call [R, C]: `rows` (at most R) lists of prefixes sharing a
        row."""
        e = self.ecfg
        ps = e.page_size
        tokens, positions, segments, pages, offsets = (np.zeros((R, C), np.int32)
                                                       for _ in range(5))
        rope = np.zeros((3, R, C), np.int32) if multimodal else None
        pieces = []
        for r, row in enumerate(rows):
            at = 0
            for s, pre in enumerate(row, 1):
                n = min(pre.cached, C)
                j = np.arange(n)
                sl = slice(at, at + n)
                tokens[r, sl], positions[r, sl], segments[r, sl] = pre.tokens[:n], j, s
                pages[r, sl] = np.asarray(pre.pages, np.int32)[j // ps]
                offsets[r, sl] = j % ps
                if multimodal:
                    rope[:, r, sl] = pre.positions[:, :n]
                    pieces.append((r, at, pre.embeds, 0, n))
                at += n
        embeds = (embed_rows(R, C, self.cfg.d_model, self.cfg.dtype, pieces) if multimodal
                  else None)
        return prefill_packed(self.cfg, e, params, kp, vp, tokens, positions, segments, pages,
                              offsets, embeds_BCD=embeds, rope_pos_3BC=rope)

    def _prefill_call(self, params, kp, vp, prefixes, start, B: int, C: int):
        """One `prefill_chunk` call [B, C]: tokens [start, start + C) of each prefix (at most
        B), one a row, attending to their pages."""
        tokens = np.zeros((B, C), np.int32)
        n_valid = np.zeros(B, np.int32)
        table = np.full((B, self.ecfg.pages_per_slot), NULL_PAGE, np.int32)
        for r, pre in enumerate(prefixes):
            chunk = pre.tokens[start:min(start + C, pre.cached)]
            tokens[r, :chunk.size] = chunk
            n_valid[r] = chunk.size
            table[r] = self.page_row(pre.pages)
        embeds = rope = None
        if prefixes[0].embeds is not None:
            rope = np.zeros((3, B, C), np.int32)
            for r, pre in enumerate(prefixes):
                rope[:, r, :n_valid[r]] = pre.positions[:, start:start + n_valid[r]]
            embeds = embed_rows(B, C, self.cfg.d_model, self.cfg.dtype,
                                [(r, 0, pre.embeds, start, int(n_valid[r]))
                                 for r, pre in enumerate(prefixes)])
        return prefill_chunk(self.cfg, self.ecfg, params, kp, vp, tokens,
                             np.full(B, start, np.int32), n_valid, table, first=False,
                             embeds_BCD=embeds, rope_pos_3BC=rope)

    def prefill(self, params, decode_state: DecodeState, tokens):
        """-> (prefix, decode_state). Unlike JetStream's prefill it takes the decode state:
        the prompt's KV goes straight into pool pages, with no dense copy to insert later."""
        prefix = self.reserve_prefix(tokens)
        return prefix, self.run_prefill(params, decode_state, [prefix])

    # ---- insert
    def reserve_slot(self, prefix: Prefix, slot: int, sample_id: int, max_new_tokens: int,
                     last: bool = False, first_tokens: Optional[int] = None) -> SlotPlan:
        """Pages for one sample of `prefix`: all it may write, or with `first_tokens` only
        those of its first tokens (the slot then `grow`s, call by call). The prompt's last
        sample (`last`) takes over its partly filled page instead of copying it; the prefix
        then takes no more samples."""
        if self.slot_pages[slot] is not None:
            raise ValueError(f"slot {slot} is in use; free it first")
        if prefix.closed:
            raise ValueError("this prefix already gave its partial page to its last sample")
        T = len(prefix.tokens)
        self.check_fits(T, max_new_tokens)
        full = prefix.full_pages
        n_own = self.sample_pages(T, max_new_tokens if first_tokens is None
                                  else max(1, min(first_tokens, max_new_tokens)))
        self.pool.share(full)
        src = dst = NULL_PAGE
        if prefix.partial and last:
            own = [prefix.pages[-1]] + self.pool.alloc(n_own - 1)   # its reference moves
            prefix.holds = [p for p in prefix.holds if p != prefix.pages[-1]]
        else:
            own = self.pool.alloc(n_own)
            if prefix.partial:
                src, dst = prefix.pages[-1], own[0]
        prefix.closed = last
        self.slot_pages[slot] = full + own
        return SlotPlan(slot, prefix, sample_id, max_new_tokens, full + own, src, dst,
                        prefix.cached, int(prefix.tokens[-1]), prefix.rope_delta)

    def run_insert(self, state: DecodeState, plans) -> DecodeState:
        B = self.ecfg.max_slots
        slot = np.full(B, B, np.int32)                  # index B (no slot): dropped
        rows = np.zeros((B, self.ecfg.pages_per_slot), np.int32)
        length, token, remaining, sample_id, src, dst, delta, steps = (np.zeros(B, np.int32)
                                                                       for _ in range(8))
        for i, p in enumerate(plans):
            slot[i], rows[i] = p.slot, self.page_row(p.pages)
            length[i], token[i] = p.length, p.token
            remaining[i] = p.max_new_tokens if p.remaining is None else p.remaining
            sample_id[i] = p.sample_id
            src[i], dst[i] = p.copy_src, p.copy_dst
            delta[i], steps[i] = p.rope_delta, p.steps
        return insert_slots(state, slot, rows, length, token, remaining, sample_id, src, dst,
                            num_layers=self.cfg.n_layers, delta_B=delta, steps_B=steps)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slots, *, sample_ids=None,
               max_new_tokens: int, last: bool = False) -> DecodeState:
        """Places one prefill into one or many slots (they share its full pages). `last`: no
        more samples of this prefix follow, so the final slot keeps its partial page."""
        sample_ids = list(range(len(slots))) if sample_ids is None else list(sample_ids)
        plans = [self.reserve_slot(prefix, s, u, max_new_tokens, last=last and i == len(slots) - 1)
                 for i, (s, u) in enumerate(zip(slots, sample_ids))]
        return self.run_insert(decode_state, plans)

    def release(self, prefix: Prefix) -> None:
        """Drops the prefix's own hold on its pages (after its last insert has run)."""
        self.pool.release(prefix.holds)
        prefix.holds = []

    # ---- generate / free
    def decode_params(self, params):
        """The weights relaid for decode steps (lrl.rollout.weights); pass them to generate."""
        return decode_params(self.cfg, params, self.mesh)

    def generate(self, params, decode_state: DecodeState, rng, num_steps: int = 1,
                 sampling=None, eos_ids=None, rows=None):
        """-> (decode_state, StepOutput [num_steps, B]) for every live slot. `params` in the
        training layout work too, slower: prefer `decode_params(params)`, once per rollout.
        `sampling` / `eos_ids` override the engine config's for this call (another compiled
        decode program for each distinct setting). `rows`: the slots that may be live (every
        other one idle); when they fit one of `narrow_widths`, only that many rows are
        decoded (`decode_rows`), the output still [num_steps, B].

        If a Pallas kernel (attention or sampling) fails to lower (an unsupported shape or jax
        version), the engine warns once and continues with the XLA paths; `self.fallback` says
        why."""
        over = {k: v for k, v in (("sampling", sampling), ("eos_ids", eos_ids)) if v is not None}
        ecfg = dataclasses.replace(self.ecfg, **over) if over else self.ecfg
        width = self.width_for(len(rows)) if rows is not None else ecfg.max_slots
        program, args = decode_steps, (params, decode_state, rng)
        if width < ecfg.max_slots:
            ecfg = self._narrow_ecfg(ecfg, width)
            live = set(rows)
            idle = [s for s in range(ecfg.max_slots) if s not in live]
            rows_W = np.asarray(list(rows) + idle[:width - len(rows)], np.int32)
            program, args = decode_rows, args + (rows_W,)
        step = lambda e: program(self.cfg, e, *args, num_steps=num_steps)  # noqa: E731
        on_gpu = ecfg.attention_impl in pa.PALLAS or ecfg.sampling_impl == "pallas"
        if not on_gpu or self._pallas_ok:
            return step(ecfg)
        try:   # lowering errors surface before dispatch, so the donated state is intact
            program.lower(self.cfg, ecfg, *args, num_steps=num_steps).compile()
            self._pallas_ok = True
        except Exception as e:  # noqa: BLE001
            self.fallback = f"{type(e).__name__}: {e}"[:500]
            warnings.warn(f"Pallas kernels failed to compile, using the XLA paths: "
                          f"{self.fallback}")
            self.ecfg = dataclasses.replace(self.ecfg, attention_impl="xla", sampling_impl="xla")
            ecfg = dataclasses.replace(ecfg, attention_impl="xla", sampling_impl="xla")
        return step(ecfg)

    def width_for(self, live: int) -> int:
        """Rows a decode call computes for `live` slots: the narrowest of `narrow_widths`
        that holds them, else all `max_slots`."""
        fits = [w for w in self.ecfg.narrow_widths if w >= live]
        return min(fits) if fits else self.ecfg.max_slots

    def _narrow_ecfg(self, ecfg: EngineConfig, width: int) -> EngineConfig:
        """The config of a W-row decode call: the attention kernel's kv splits chosen for W
        rows (fewer rows want more splits to fill the GPU) where the page table's width stays
        the same."""
        c = self.cfg
        kv_programs = c.n_kv_heads // paged_kernel.kv_heads_per_program(
            c.n_heads, c.n_kv_heads, ecfg.pallas_kv_per_program)
        narrow = dataclasses.replace(ecfg, pallas_k_splits=max(
            ecfg.pallas_k_splits, k_splits(width, kv_programs)))
        return narrow if narrow.pages_per_slot == ecfg.pages_per_slot else ecfg

    # ---- the state kept between rollouts
    def take_state(self) -> DecodeState:
        """The engine's decode state (its pool and slot arrays), created once and handed out
        to one rollout at a time: between rollouts every slot is idle and every page free but
        those of kept samples, so a rollout starts from it as from a fresh one (with those
        pages taken), without allocating the pool again."""
        state, self._state = self._state, None
        if state is None:
            if self._made_state:
                raise RuntimeError("the engine's decode state is out with another rollout")
            state = self.init_decode_state()
            self._made_state = True
        return state

    def keep_state(self, state: DecodeState) -> None:
        """Takes the state back after a rollout (all its pages free but the kept samples')."""
        held = np.zeros_like(self.pool.refcount)
        for k in self.kept.values():
            np.add.at(held, np.asarray(k.pages, np.int64), 1)
        if not np.array_equal(held, self.pool.refcount):
            raise RuntimeError(f"{self.pool.num_used} pages still in use after the rollout, "
                               f"{int((held > 0).sum())} of them by {len(self.kept)} kept "
                               f"samples: the rest leaked")
        self._state = state

    # ---- samples kept between rollouts
    def keep(self, decode_state: DecodeState, slots, lengths, tokens, rope_deltas):
        """Stops the slots but leaves their pages in the pool: -> (decode_state, a `Kept` per
        slot, with the tokens in its cache and the next token it feeds), for a later rollout
        to resume without a prefill."""
        mask = np.zeros(self.ecfg.max_slots, bool)
        handles = []
        for s, n, t, d in zip(slots, lengths, tokens, rope_deltas):
            if self.slot_pages[s] is None:
                raise ValueError(f"slot {s} is not in use")
            k = Kept(self, self.slot_pages[s], int(n), int(t), int(d))
            self.kept[id(k)] = k
            handles.append(k)
            self.slot_pages[s] = None
            mask[s] = True
        return (deactivate(decode_state, mask) if mask.any() else decode_state), handles

    def holds(self, kept: Kept) -> bool:
        return self.kept.get(id(kept)) is kept

    def resume_pages(self, kept: Kept, new_tokens: int) -> int:
        """Pages a kept sample lacks to sample `new_tokens` more."""
        return max(0, pages_for(kept.length + new_tokens, self.ecfg.page_size) - len(kept.pages))

    def resume_slot(self, kept: Kept, slot: int, sample_id: int, max_new_tokens: int,
                    first_tokens: Optional[int] = None) -> SlotPlan:
        """A kept sample back in slot `slot`: its own page row (grown for all it may write, or
        with `first_tokens` for those), its cache length and next token; nothing is prefilled
        or copied. The handle is spent."""
        if self.slot_pages[slot] is not None:
            raise ValueError(f"slot {slot} is in use; free it first")
        if not self.holds(kept):
            raise ValueError("this engine does not hold that kept sample (resumed or released "
                             "already, or another engine's)")
        n = max_new_tokens if first_tokens is None else max(1, min(first_tokens, max_new_tokens))
        pages = kept.pages + self.pool.alloc(self.resume_pages(kept, n))
        del self.kept[id(kept)]
        self.slot_pages[slot] = pages
        return SlotPlan(slot, None, sample_id, max_new_tokens, pages, NULL_PAGE, NULL_PAGE,
                        kept.length, kept.token, kept.rope_delta)

    def extend_pages(self, kept: Kept, observed: int, new_tokens: int) -> int:
        """Pages a kept sample lacks to take `observed` tokens and sample `new_tokens` more."""
        return self.resume_pages(kept, observed + new_tokens)

    def extend_slot(self, kept: Kept, slot: int, sample_id: int, max_new_tokens: int,
                    observation, first_tokens: Optional[int] = None, steps: int = 0):
        """A kept (waiting) multi-turn sample back in slot `slot` with `observation`
        appended: its page row grown for the observation and all it may sample (or its
        `first_tokens`); nothing of its history is prefilled again. -> (its insert plan,
        the `Extension` to prefill first: its last sampled token, never cached, and the
        observation but its last token, which the slot feeds). The handle is spent."""
        obs = np.asarray(observation, np.int32)
        n = max_new_tokens if first_tokens is None else max(1, min(first_tokens, max_new_tokens))
        length = kept.length + obs.size
        if pages_for(length + n, self.ecfg.page_size) > self.ecfg.pages_per_slot:
            raise ValueError(f"a sample of {length} cached tokens + {n} new needs more than the "
                             f"engine's {self.ecfg.pages_per_slot} pages per slot")
        if self.slot_pages[slot] is not None:
            raise ValueError(f"slot {slot} is in use; free it first")
        if not self.holds(kept):
            raise ValueError("this engine does not hold that kept sample")
        pages = kept.pages + self.pool.alloc(self.extend_pages(kept, obs.size, n))
        del self.kept[id(kept)]
        self.slot_pages[slot] = pages
        ext = Extension(pages, kept.length,
                        np.concatenate([[kept.token], obs[:-1]]).astype(np.int32))
        return SlotPlan(slot, None, sample_id, max_new_tokens, pages, NULL_PAGE, NULL_PAGE,
                        length, int(obs[-1]), kept.rope_delta, steps=steps), ext

    def extend_chunk(self, n: int) -> int:
        """C of the call that prefills an extension of n tokens: a power of two from 16 to
        `prefill_chunk` (longer ones go in chunks of that)."""
        return min(self.ecfg.prefill_chunk, max(16, 1 << max(0, n - 1).bit_length()))

    def extend_calls(self, extensions) -> list:
        """The calls that prefill `extensions`: (the extensions of the call, the offset into
        their tokens, R, C) each. C is `extend_chunk`'s, R = turn_prefill_tokens // C rows (1
        to max_slots), or a quarter of that when a quarter holds them: two programs per C
        whatever the number of samples (`compile_extend` compiles them up front)."""
        by_chunk: dict[int, list] = {}
        for x in extensions:
            by_chunk.setdefault(self.extend_chunk(len(x.tokens)), []).append(x)
        calls = []
        for C, group in sorted(by_chunk.items()):
            for start in range(0, max(len(x.tokens) for x in group), C):
                todo = [x for x in group if len(x.tokens) > start]
                R = self._extend_rows(C, len(todo))
                calls += [(part, start, R, C) for part in _batches(todo, R)]
        return calls

    def run_extend(self, params, state: DecodeState, calls) -> DecodeState:
        """Prefills extensions' tokens into their pages after the positions they hold, in the
        `prefill_chunk` calls [R, C] that `extend_calls` planned for them, each attending to
        the pages already written."""
        kp, vp = state.k_pages, state.v_pages
        for part, start, R, C in calls:
            kp, vp = self._extend_call(params, kp, vp, part, start, R, C)
        return state._replace(k_pages=kp, v_pages=vp)

    def compile_extend(self, params, state: DecodeState, lengths) -> DecodeState:
        """Runs the observation prefill's calls for extensions of `lengths` tokens once on
        empty rows (every token written to the null page). -> the state."""
        kp, vp = state.k_pages, state.v_pages
        for C in sorted({self.extend_chunk(n) for n in lengths}):
            for R in sorted({self._extend_rows(C, 1), self._extend_rows(C, 1 << 30)}):
                kp, vp = self._extend_call(params, kp, vp, [], 0, R, C)
        return state._replace(k_pages=kp, v_pages=vp)

    def _extend_rows(self, C: int, needed: int) -> int:
        """R of an extension call of C tokens a row for `needed` rows: the full R, or a
        quarter of it when that holds them (a round resumes a few samples more often than
        many: a full call computed mostly padding)."""
        full = max(1, min(self.ecfg.max_slots, self.ecfg.turn_prefill_tokens // C))
        return max(1, full // 4) if needed <= full // 4 else full

    def _extend_call(self, params, kp, vp, extensions, at: int, R: int, C: int):
        """One `prefill_chunk` call [R, C]: tokens [at, at + C) of each extension, one a row,
        at cache positions from its start on."""
        tokens = np.zeros((R, C), np.int32)
        start, n_valid = np.zeros(R, np.int32), np.zeros(R, np.int32)
        table = np.full((R, self.ecfg.pages_per_slot), NULL_PAGE, np.int32)
        for r, x in enumerate(extensions):
            chunk = x.tokens[at:at + C]
            tokens[r, :chunk.size] = chunk
            start[r], n_valid[r] = x.start + at, chunk.size
            table[r] = self.page_row(x.pages)
        return prefill_chunk(self.cfg, self.ecfg, params, kp, vp, tokens, start, n_valid, table,
                             first=False, block_pages=self.ecfg.extend_block_pages)

    def release_kept(self, handles) -> int:
        """Returns kept samples' pages to the pool (each to its own engine's); None and handles
        no longer held (resumed, released before) are skipped. -> how many were released."""
        n = 0
        for k in handles:
            if k is not None and k.engine.kept.pop(id(k), None) is k:
                k.engine.pool.release(k.pages)
                n += 1
        return n

    def pages_short(self, slot: int, tokens: int) -> int:
        """Pages slot `slot` lacks to hold its first `tokens` cache positions."""
        return max(0, pages_for(tokens, self.ecfg.page_size) - len(self.slot_pages[slot]))

    def grow(self, slot: int, tokens: int) -> bool:
        """Gives slot `slot` pages for its first `tokens` cache positions (pages at the end of
        its row); the device sees them after `with_page_table`. Returns whether its row
        changed. Raises OutOfPages when the pool is short."""
        short = self.pages_short(slot, tokens)
        if short:
            self.slot_pages[slot] = self.slot_pages[slot] + self.pool.alloc(short)
        return bool(short)

    def with_page_table(self, decode_state: DecodeState) -> DecodeState:
        """The decode state with every slot's page row as the host holds it (after `grow`)."""
        table = np.full((self.ecfg.max_slots, self.ecfg.pages_per_slot), NULL_PAGE, np.int32)
        for s, pages in enumerate(self.slot_pages):
            if pages:
                table[s, :len(pages)] = pages
        return decode_state._replace(page_table=jax.device_put(
            table, decode_state.page_table.sharding))

    def free(self, decode_state: DecodeState, slots) -> DecodeState:
        """Stops the slots and returns their pages to the pool."""
        mask = np.zeros(self.ecfg.max_slots, bool)
        for s in slots:
            if self.slot_pages[s] is None:
                raise ValueError(f"slot {s} is not in use")
            self.pool.release(self.slot_pages[s])
            self.slot_pages[s] = None
            mask[s] = True
        return deactivate(decode_state, mask) if mask.any() else decode_state
