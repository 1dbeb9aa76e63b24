"""Packing of variable-length (prompt, completion) sequences into fixed-length rows [B, T].

B batch rows · T positions in a row.

A sequence is ``prompt + completion``; several sequences share a row, each one a *segment*.
`pack` returns numpy arrays (host side; the loop shards them onto the mesh):

  tokens       int32 [B, T]  the token ids, 0 on padding
  positions    int32 [B, T]  0, 1, ... restarting at every segment, 0 on padding
  segment_ids  int32 [B, T]  1, 2, ... the segment's index within its row; 0 = padding
  targets      int32 [B, T]  the next token of the same segment; 0 at a segment's last
                             position and on padding
  loss_mask  float32 [B, T]  1.0 where the TARGET is a completion token, i.e. positions
                             ``len(prompt) - 1 ... len(prompt) + len(completion) - 2``
  <seq key>  float32 [B, T]  a per-sequence value (e.g. the advantage) on every position of
                             its segment, 0 on padding
  <tok key>  float32 [B, T]  a per-completion-token value (e.g. old log-prob of completion
                             token j) at the position whose target is that token, else 0

Rows are filled by first-fit decreasing (longest sequence first, into the first row with
room) or, `fit="best"`, best-fit decreasing (into the row it fills most), with at most
`max_segments` sequences a row when given (cuDNN's packed attention takes a bounded number
of runs a row). A row's sequences lie one after another from position 0, so a row holding n
tokens is whole in its first n positions. Their number is padded with empty rows up to a
multiple the caller gives. `unpack` inverts `pack` through the returned layout; `sft_pack`
is `pack` for (prompt, response) records.

For an update cut by a token budget (a `Cut`), `balance_rows` spreads the packed rows over
the data-parallel shards so every shard gets nearly the same tokens (largest row first, to
the shard with the fewest tokens, as LPT scheduling), and `micro_batches` cuts the rows into
micro-batches of [shards x rows_per_shard, T] and, for the last rows, [shards, T'], T' the
shortest of the cut's row lengths that holds the tokens of each shard's row there; each
shard's rows in its block. Best fit given the cut packs those last rows again, into rows as
short as they can be (`best_fit`), so a minibatch's last micro-batches cost about what they
hold rather than a full row each.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

BASE_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")


@dataclasses.dataclass(frozen=True)
class Cut:
    """How the update cuts a minibatch's rows into micro-batches: `rows_per_shard` rows of
    each of `shards` data shards while every shard has that many full ones (a row is full
    when no shorter length holds it), then one row a shard, cut to the shortest of `lengths`
    that holds the tokens of every shard's row there. `lengths`: the packed row length T
    first, then shorter ones, longest first (`lrl.rl.budget.row_lengths`)."""
    shards: int
    rows_per_shard: int
    lengths: tuple

    def __post_init__(self):
        L = tuple(int(n) for n in self.lengths)
        if (self.shards < 1 or self.rows_per_shard < 1 or not L or min(L) < 1
                or any(a <= b for a, b in zip(L, L[1:]))):
            raise ValueError(f"Cut: need shards >= 1 (got {self.shards}), rows_per_shard >= 1 "
                             f"(got {self.rows_per_shard}) and decreasing positive lengths "
                             f"(got {self.lengths})")
        object.__setattr__(self, "lengths", L)

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every micro-batch shape the cut gives, as (rows a shard, row length)."""
        T, K = self.lengths[0], self.rows_per_shard
        return tuple(dict.fromkeys(((K, T),) + tuple((1, n) for n in self.lengths)))

    def length_for(self, tokens: int) -> int:
        """The shortest of the lengths that holds a row of `tokens` tokens."""
        return min(n for n in self.lengths if n >= tokens)


def first_fit(lengths: Sequence[int], row_len: int, *, decreasing: bool = True,
              max_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Places sequences of `lengths` into rows of `row_len` tokens.

    Returns (row, start) per sequence, in input order; with `max_rows`, sequences that fit in
    no row get row = start = -1. Ties keep input order, so the placement is deterministic.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > row_len:
        i = int(np.argmax(lengths))
        raise ValueError(f"first_fit: sequence {i} has {lengths[i]} tokens > row_len {row_len}")
    order = np.argsort(-lengths, kind="stable") if decreasing else np.arange(lengths.size)
    row = np.full(lengths.size, -1, np.int64)
    start = np.full(lengths.size, -1, np.int64)
    used = np.zeros(0, np.int64)  # tokens used per open row
    for i in order:
        fits = np.flatnonzero(used + lengths[i] <= row_len)
        if fits.size:
            r = int(fits[0])
        elif max_rows is None or used.size < max_rows:
            r = used.size
            used = np.append(used, 0)
        else:
            continue
        row[i], start[i] = r, used[r]
        used[r] += lengths[i]
    return row, start


def best_fit(lengths: Sequence[int], row_len: int, *, max_segments: int | None = None,
             segments: Sequence[int] | None = None,
             cut: Cut | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: longest sequence first, each into the open row whose room it
    fills most (a new row when none has room, or when the rows with room would hold more
    than `max_segments` segments with it). A sequence is one segment unless `segments` says
    how many it brings (a shared-prompt group: its prefix and its responses). With a `cut`
    whose lengths go below `row_len`, the rows its one-row micro-batches would take are
    packed again into short rows (`_refit_tail`); row numbers then run over the full rows
    first. Returns (row, start) per sequence, in input order; ties keep input order, so the
    placement is deterministic."""
    lengths = np.asarray(lengths, np.int64)
    weight = (np.ones(lengths.size, np.int64) if segments is None
              else np.asarray(segments, np.int64))
    if weight.shape != lengths.shape:
        raise ValueError(f"best_fit: {weight.size} segment counts for {lengths.size} sequences")
    if lengths.size and lengths.max() > row_len:
        i = int(np.argmax(lengths))
        raise ValueError(f"best_fit: sequence {i} has {lengths[i]} tokens > row_len {row_len}")
    if max_segments is not None and (max_segments < 1 or (weight.size and
                                                          weight.max() > max_segments)):
        raise ValueError(f"best_fit: max_segments={max_segments} must be >= 1 and at least "
                         f"the segments of any one sequence ({weight.max(initial=1)})")
    if cut is not None and cut.lengths[0] != row_len:
        raise ValueError(f"best_fit: the cut's rows are {cut.lengths[0]} tokens, not row_len "
                         f"{row_len}")
    order = np.argsort(-lengths, kind="stable")
    row, start = _fill(order, lengths, weight, [], max_segments, open_len=row_len)
    if cut is not None and len(cut.lengths) > 1 and lengths.size:
        row, start = _refit_tail(lengths, weight, row, start, max_segments, cut)
    return row, start


def _fill(order, lengths, weight, room, max_segments, open_len=None):
    """Best fit of the sequences `order`, in that order, into rows of `room` tokens each, and
    into new rows of `open_len` when none has room (None: a sequence that fits nowhere gets
    row = start = -1) -> (row, start) per sequence, -1 for those not in `order`."""
    row = np.full(lengths.size, -1, np.int64)
    start = np.full(lengths.size, -1, np.int64)
    cap = np.asarray(room, np.int64)
    used = np.zeros(cap.size, np.int64)
    count = np.zeros(cap.size, np.int64)
    for i in order:
        left = cap - used - lengths[i]
        ok = left >= 0
        if max_segments is not None:
            ok &= count + weight[i] <= max_segments
        if ok.any():
            r = int(np.flatnonzero(ok)[np.argmin(left[ok])])
        elif open_len is not None:
            r = cap.size
            cap, used, count = np.append(cap, open_len), np.append(used, 0), np.append(count, 0)
        else:
            continue
        row[i], start[i] = r, used[r]
        used[r] += lengths[i]
        count[r] += weight[i]
    return row, start


def _refit_tail(lengths, weight, row, start, max_segments, cut: Cut):
    """Best fit's rows -> the same with the rows that would ride in one-row micro-batches
    packed again, as rounds of one row a shard of one of the cut's lengths (`_tail_rounds`).
    Rows that no shorter length could hold for less, in whole micro-batches of
    `rows_per_shard` rows a shard, stay as they are and come first: those with the longest
    sequences, which short rows could not take."""
    T, S, K = cut.lengths[0], cut.shards, cut.rows_per_shard
    used = np.bincount(row, weights=lengths, minlength=int(row.max()) + 1).astype(np.int64)
    longest = np.zeros(used.size, np.int64)
    np.maximum.at(longest, row, lengths)
    full = np.flatnonzero(used > T - cut.lengths[-1])
    full = full[np.lexsort((-used[full], -longest[full]))]
    body = np.sort(full[:full.size // (S * K) * (S * K)])
    new_row = np.full(row.size, -1, np.int64)
    new_start = np.full(row.size, -1, np.int64)
    kept = np.isin(row, body)
    new_row[kept] = np.searchsorted(body, row[kept])
    new_start[kept] = start[kept]
    rest = np.flatnonzero(~kept)
    at = body.size
    for r, st in _tail_rounds(rest[np.argsort(-lengths[rest], kind="stable")], lengths, weight,
                              max_segments, S, cut.lengths):
        placed = r >= 0
        new_row[placed], new_start[placed] = at + r[placed], st[placed]
        at += S
    # A round's rows that got nothing leave no empty row behind.
    return np.unique(new_row, return_inverse=True)[1].astype(np.int64), new_start


def _tail_rounds(items, lengths, weight, max_segments, shards: int, row_lengths):
    """The sequences `items` (longest first) -> rounds of `shards` rows of one of
    `row_lengths` each, as (row within the round, start) per sequence, that hold them all in
    the fewest positions this search finds, then the fewest rounds. It follows one chain:
    while the rest does not fit the rounds so far, the next is filled best fit in the
    longest length shorter than the shortest whose round would hold all the rest (the full
    length while none would); each point of the chain is scored as if that shortest round
    ended it."""
    best, chain, cost = None, [], 0
    asc = sorted(row_lengths)
    while True:
        if not items.size:
            if best is None or (cost, len(chain)) < best[:2]:
                best = (cost, len(chain), list(chain))
            break
        total = int(lengths[items].sum())
        holds = None
        for n in asc:
            if shards * n >= total:
                r, st = _fill(items, lengths, weight, [n] * shards, max_segments)
                if (r[items] >= 0).all():
                    holds = n
                    break
        if holds is not None:
            if best is None or (cost + shards * holds, len(chain) + 1) < best[:2]:
                best = (cost + shards * holds, len(chain) + 1, chain + [(r, st)])
            shorter = [n for n in row_lengths if n < holds]
            if not shorter:
                break
            n = shorter[0]
        else:
            n = row_lengths[0]
        if best is not None and cost + shards * n >= best[0]:
            break
        r, st = _fill(items, lengths, weight, [n] * shards, max_segments)
        placed = r[items] >= 0
        if not placed.any():
            break
        chain.append((r, st))
        cost += shards * n
        items = items[~placed]
    return best[2]


def balance_rows(row_tokens: Sequence[int], num_shards: int) -> list[list[int]]:
    """Rows -> the rows of each data shard: largest first, each to the shard with the fewest
    tokens among those with the fewest rows, so the shards' row counts differ by at most one
    and their token counts are close (LPT under equal counts)."""
    tokens = np.asarray(row_tokens, np.int64)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    load = np.zeros(num_shards, np.int64)
    for r in np.argsort(-tokens, kind="stable"):
        counts = np.array([len(s) for s in shards])
        open_ = np.flatnonzero(counts == counts.min())
        s = int(open_[np.argmin(load[open_])])
        shards[s].append(int(r))
        load[s] += tokens[r]
    return shards


def _extents(segment_ids: np.ndarray) -> np.ndarray:
    """[B] the positions each row needs: up to its last token (0 for an empty row)."""
    has = np.asarray(segment_ids) > 0
    return np.where(has.any(axis=1), has.shape[1] - np.argmax(has[:, ::-1], axis=1), 0)


def _shard_rows(batch: Mapping[str, np.ndarray], cut: Cut):
    """(extents, each shard's rows by `balance_rows`, longest first); rows with no token at
    all are dropped: they cost nothing."""
    seg = np.asarray(batch["segment_ids"])
    if seg.shape[1] != cut.lengths[0]:
        raise ValueError(f"micro_batches: rows of {seg.shape[1]} tokens for a cut of "
                         f"{cut.lengths[0]}")
    extent = _extents(seg)
    live = np.flatnonzero(extent > 0)
    return extent, [[int(live[r]) for r in rows] for rows in balance_rows(extent[live],
                                                                          cut.shards)]


def micro_plan(batch: Mapping[str, np.ndarray], cut: Cut) -> tuple[tuple[int, int], ...]:
    """The micro-batch shapes `micro_batches` cuts `batch` into, in order, as (rows a shard,
    row length): `rows_per_shard` full rows a shard while every shard has that many, then
    for each next row of the shards the shortest length that holds all of them. One
    micro-batch even of no rows."""
    extent, per_shard = _shard_rows(batch, cut)
    T, K = cut.lengths[0], cut.rows_per_shard
    need = [[cut.length_for(extent[r]) for r in rows] for rows in per_shard]
    blocks = min(x.count(T) for x in need) // K
    rest = [x[blocks * K:] for x in need]
    tail = [max(x[j] for x in rest if j < len(x)) for j in range(max(map(len, rest)))]
    return ((K, T),) * blocks + tuple((1, n) for n in tail) or ((1, cut.lengths[-1]),)


def common_plan(plans: Sequence[Sequence[tuple[int, int]]], cut: Cut) -> tuple:
    """One plan for several processes' rows (`micro_plan` of each), so they run the same
    sequence of shapes: the fewest micro-batches of `rows_per_shard` full rows any has,
    then for each one-row micro-batch after them the longest length any needs there (a
    process's further full-row micro-batches count as that many full one-row ones)."""
    T, K = cut.lengths[0], cut.rows_per_shard
    blocks = [sum(k == K > 1 for k, _ in p) for p in plans]
    tails = [[T] * (K * (b - min(blocks))) + [n for k, n in p if k == 1]
             for p, b in zip(plans, blocks)]
    return ((K, T),) * min(blocks) + tuple(
        (1, max(t[j] for t in tails if j < len(t))) for j in range(max(map(len, tails))))


def micro_batches(batch: Mapping[str, np.ndarray], cut: Cut,
                  plan: Sequence[tuple[int, int]] | None = None) -> list[dict[str, np.ndarray]]:
    """Packed rows -> micro-batches of [shards x k, ..., n] arrays, one for each (k, n) of
    `plan` (by default `micro_plan`'s): the next k rows of each shard's list, shard s in
    rows [s·k, (s+1)·k) (rows shard over devices in contiguous blocks), each array cut to
    its first n positions (a row's tokens lie there; every per-row array, [B, T] or
    [B, 3, T], is cut alike). Rows are balanced over shards by tokens (`balance_rows`). A
    shard short of rows gets empty ones (all zeros, segment 0: no loss, no gradient), and
    plan entries past the last rows give empty micro-batches. `plan`: one that several
    processes agree on (`common_plan`), so they run the same sequence of shapes."""
    extent, per_shard = _shard_rows(batch, cut)
    plan = micro_plan(batch, cut) if plan is None else tuple(plan)
    out, at = [], 0
    for k, n in plan:
        pick = np.full(cut.shards * k, -1, np.int64)
        for s, rows in enumerate(per_shard):
            part = rows[at:at + k]
            if part and extent[part].max() > n:
                raise ValueError(f"micro_batches: a row of {extent[part].max()} tokens in a "
                                 f"micro-batch of rows of {n} (plan {plan})")
            pick[s * k:s * k + len(part)] = part
        at += k
        mb = {}
        for key, x in batch.items():
            x = np.asarray(x)
            y = np.zeros((cut.shards * k,) + x.shape[1:-1] + (n,), x.dtype)
            y[pick >= 0] = x[pick[pick >= 0], ..., :n]
            mb[key] = y
        out.append(mb)
    if any(len(rows) > at for rows in per_shard):
        raise ValueError(f"micro_batches: plan {plan} holds {at} rows a shard, a shard has "
                         f"{max(map(len, per_shard))}")
    return out


def _as_ids(x: Any, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"pack: {what} must be a 1-D integer array, got shape {a.shape} "
                         f"dtype {a.dtype}")
    return a.astype(np.int32)


def checked_sequences(prompts, completions, row_len: int, seq_values: Mapping,
                      token_values: Mapping, *, rows_multiple: int = 1, min_rows: int = 0,
                      truncate: bool = False, reserved: Sequence[str] = ()):
    """`pack`'s inputs checked and, with `truncate`, completions (and their token values) cut
    so that prompt + completion fits `row_len` -> (prompt ids, completion ids, token values,
    sequences truncated, tokens truncated). `reserved`: output keys beyond BASE_KEYS."""
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"pack: {n} prompts but {len(completions)} completions")
    if row_len < 2 or rows_multiple < 1 or min_rows < 0:
        raise ValueError(f"pack: need row_len >= 2 (got {row_len}), rows_multiple >= 1 "
                         f"(got {rows_multiple}), min_rows >= 0 (got {min_rows})")
    for key in list(seq_values) + list(token_values):
        if key in BASE_KEYS + tuple(reserved) or (key in seq_values and key in token_values):
            raise ValueError(f"pack: value key {key!r} clashes with another output key")
    for key, vals in {**seq_values, **token_values}.items():
        if len(vals) != n:
            raise ValueError(f"pack: values {key!r} have {len(vals)} entries for {n} sequences")

    p_ids = [_as_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
    c_ids = [_as_ids(c, f"completion {i}") for i, c in enumerate(completions)]
    tok_vals = {k: [np.asarray(v, np.float32).reshape(-1) for v in vs]
                for k, vs in token_values.items()}
    num_truncated = truncated_tokens = 0
    for i in range(n):
        p, c = len(p_ids[i]), len(c_ids[i])
        if p < 1:
            raise ValueError(f"pack: prompt {i} is empty; its first completion token would "
                             "have no position to be predicted from")
        for key, vs in tok_vals.items():
            if vs[i].size != c:
                raise ValueError(f"pack: token values {key!r} of sequence {i} have "
                                 f"{vs[i].size} entries for {c} completion tokens")
        if p + c > row_len:
            if not truncate:
                raise ValueError(f"pack: sequence {i} has {p} prompt + {c} completion tokens "
                                 f"> row_len {row_len} (pass truncate=True to cut completions)")
            if p >= row_len:
                raise ValueError(f"pack: prompt {i} has {p} tokens, leaving no room for its "
                                 f"completion in row_len {row_len}")
            keep = row_len - p
            num_truncated += 1
            truncated_tokens += c - keep
            c_ids[i] = c_ids[i][:keep]
            for vs in tok_vals.values():
                vs[i] = vs[i][:keep]
    return p_ids, c_ids, tok_vals, num_truncated, truncated_tokens


def pack(prompts: Sequence[Any], completions: Sequence[Any], row_len: int, *,
         seq_values: Mapping[str, Sequence[float]] | None = None,
         token_values: Mapping[str, Sequence[Any]] | None = None,
         rows_multiple: int = 1, min_rows: int = 0, truncate: bool = False,
         decreasing: bool = True, fit: str = "first", max_segments: int | None = None,
         cut: Cut | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Packs ``prompts[i] + completions[i]`` into rows of `row_len` tokens.

    `seq_values[key][i]` is broadcast over sequence i; `token_values[key][i]` has one value per
    completion token of sequence i. A sequence longer than `row_len` is an error, or with
    `truncate` its completion (and its token values) is cut to fit, and counted. The number of
    rows is at least `min_rows`, rounded up to a multiple of `rows_multiple`. `cut` (with
    `fit="best"`): the micro-batches the rows go to, whose last rows are packed short
    (`best_fit`).

    Returns (batch, layout): batch as in the module docstring; layout holds per-sequence
    ``row``, ``start``, ``prompt_len``, ``completion_len`` (after truncation), the counters
    ``num_truncated`` and ``truncated_tokens``, and the value keys, for `unpack`.
    """
    seq_values, token_values = dict(seq_values or {}), dict(token_values or {})
    n = len(prompts)
    p_ids, c_ids, tok_vals, num_truncated, truncated_tokens = checked_sequences(
        prompts, completions, row_len, seq_values, token_values, rows_multiple=rows_multiple,
        min_rows=min_rows, truncate=truncate)

    p_len = np.array([len(x) for x in p_ids], np.int64)
    c_len = np.array([len(x) for x in c_ids], np.int64)
    if fit == "best":
        row, start = best_fit(p_len + c_len, row_len, max_segments=max_segments, cut=cut)
    elif fit == "first" and max_segments is None and cut is None:
        row, start = first_fit(p_len + c_len, row_len, decreasing=decreasing)
    else:
        raise ValueError(f"pack: fit={fit!r} (max_segments and cut only with fit='best'); "
                         "choose 'first' or 'best'")
    num_rows = max(int(row.max()) + 1 if n else 0, min_rows)
    num_rows = -(-num_rows // rows_multiple) * rows_multiple

    shape = (num_rows, row_len)
    batch = {"tokens": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
             "segment_ids": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
             "loss_mask": np.zeros(shape, np.float32)}
    for key in list(seq_values) + list(tok_vals):
        batch[key] = np.zeros(shape, np.float32)
    segments_in_row = np.zeros(num_rows, np.int32)
    for i in np.lexsort((start, row)):  # row by row, left to right: segment ids 1, 2, ...
        r, s, p, length = int(row[i]), int(start[i]), int(p_len[i]), int(p_len[i] + c_len[i])
        seq = np.concatenate([p_ids[i], c_ids[i]])
        segments_in_row[r] += 1
        sl = slice(s, s + length)
        batch["tokens"][r, sl] = seq
        batch["positions"][r, sl] = np.arange(length, dtype=np.int32)
        batch["segment_ids"][r, sl] = segments_in_row[r]
        batch["targets"][r, s:s + length - 1] = seq[1:]
        comp = slice(s + p - 1, s + length - 1)  # positions whose targets are completions
        batch["loss_mask"][r, comp] = 1.0
        for key, vals in seq_values.items():
            batch[key][r, sl] = vals[i]
        for key, vs in tok_vals.items():
            batch[key][r, comp] = vs[i]

    layout = {"row": row, "start": start, "prompt_len": p_len, "completion_len": c_len,
              "loss_start": start + p_len - 1, "prefix_start": np.full(n, -1, np.int64),
              "num_truncated": num_truncated, "truncated_tokens": truncated_tokens,
              "seq_keys": tuple(seq_values), "token_keys": tuple(tok_vals)}
    return batch, layout


def completion_values(x_BT: np.ndarray, layout: Mapping[str, Any]) -> list[np.ndarray]:
    """Per-sequence values of `x_BT` at the positions whose targets are completion tokens
    (e.g. log-probs computed on a packed batch), in the input order of `pack` (or of
    `lrl.data.shared_prompt.pack_groups`: the layout's ``loss_start`` says where)."""
    x_BT = np.asarray(x_BT)
    return [x_BT[r, a:a + c] for r, a, c in zip(layout["row"], layout["loss_start"],
                                                 layout["completion_len"])]


def unpack(batch: Mapping[str, np.ndarray], layout: Mapping[str, Any]) -> dict[str, list]:
    """Inverts `pack` (and `pack_groups`): per sequence, its prompt ids, completion ids, seq
    values (a float) and token values (one per completion token), each as a list in the
    input order. A shared prompt is its prefix followed by the token that opens the
    sequence's own segment."""
    out: dict[str, list] = {"prompts": [], "completions": []}
    tokens = batch["tokens"]
    for r, s, a, ps, p, c in zip(layout["row"], layout["start"], layout["loss_start"],
                                 layout["prefix_start"], layout["prompt_len"],
                                 layout["completion_len"]):
        head = tokens[r, s:a + 1] if ps < 0 else np.concatenate(
            [tokens[r, ps:ps + p - 1], tokens[r, a:a + 1]])
        out["prompts"].append(head)
        out["completions"].append(tokens[r, a + 1:a + 1 + c])
    for key in layout["seq_keys"]:
        out[key] = [float(batch[key][r, s]) for r, s in zip(layout["row"], layout["start"])]
    for key in layout["token_keys"]:
        out[key] = completion_values(batch[key], layout)
    return out


def sft_pack(prompts: Sequence[Any], responses: Sequence[Any], row_len: int, *,
             rows_multiple: int = 1, min_rows: int = 0, truncate: bool = False,
             decreasing: bool = True, train_masks: Optional[Sequence[Any]] = None,
             ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`pack` for supervised fine-tuning: the loss covers the response tokens (which should
    end with the EOS token so the model learns to stop). `train_masks[i]`, one value per
    token of response i (or None: all 1), scales its loss: 0 on what the model reads but
    does not write (a multi-turn demonstration's tool responses)."""
    if train_masks is None or all(m is None for m in train_masks):
        return pack(prompts, responses, row_len, rows_multiple=rows_multiple,
                    min_rows=min_rows, truncate=truncate, decreasing=decreasing)
    if len(train_masks) != len(responses):
        raise ValueError(f"sft_pack: {len(train_masks)} train_masks for {len(responses)} "
                         "responses")
    masks = [np.ones(len(r), np.float32) if m is None else np.asarray(m, np.float32)
             for r, m in zip(responses, train_masks)]
    batch, layout = pack(prompts, responses, row_len, rows_multiple=rows_multiple,
                         min_rows=min_rows, truncate=truncate, decreasing=decreasing,
                         token_values={"train_mask": masks})
    batch["loss_mask"] = batch["loss_mask"] * batch.pop("train_mask")
    layout["token_keys"] = ()
    return batch, layout
