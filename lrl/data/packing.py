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
of runs a row). Their number is padded with empty rows up to a multiple the caller gives.
`unpack` inverts `pack` through the returned layout; `sft_pack` is `pack` for
(prompt, response) records.

For an update cut by a token budget, `balance_rows` spreads the packed rows over the
data-parallel shards so every shard gets nearly the same tokens (largest row first, to the
shard with the fewest tokens, as LPT scheduling), and `micro_batches` cuts the rows into
micro-batches of [shards x rows_per_shard, T] and, for the last rows, [shards, T], each
shard's rows in its block.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

BASE_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")


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
             segments: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: longest sequence first, each into the open row whose room it
    fills most (a new row when none has room, or when the rows with room would hold more
    than `max_segments` segments with it). A sequence is one segment unless `segments` says
    how many it brings (a shared-prompt group: its prefix and its responses). Returns
    (row, start) per sequence, in input order; ties keep input order, so the placement is
    deterministic."""
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
    order = np.argsort(-lengths, kind="stable")
    row = np.full(lengths.size, -1, np.int64)
    start = np.full(lengths.size, -1, np.int64)
    used = np.zeros(0, np.int64)
    count = np.zeros(0, np.int64)
    for i in order:
        room = row_len - used - lengths[i]
        ok = room >= 0
        if max_segments is not None:
            ok &= count + weight[i] <= max_segments
        if ok.any():
            r = int(np.flatnonzero(ok)[np.argmin(room[ok])])
        else:
            r = used.size
            used, count = np.append(used, 0), np.append(count, 0)
        row[i], start[i] = r, used[r]
        used[r] += lengths[i]
        count[r] += weight[i]
    return row, start


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


def shard_rows(batch: Mapping[str, np.ndarray], num_shards: int) -> tuple[int, int]:
    """(fewest, most) rows a shard gets from `balance_rows`: what `micro_batches`' plan is made
    of (several processes agree on a plan from every process's counts)."""
    tokens = (np.asarray(batch["segment_ids"]) > 0).sum(axis=1)
    n = int((tokens > 0).sum())
    return n // num_shards, -(-n // num_shards)


def micro_batches(batch: Mapping[str, np.ndarray], num_shards: int, rows_per_shard: int,
                  plan: tuple[int, int] | None = None) -> list[dict[str, np.ndarray]]:
    """Packed rows -> micro-batches of [num_shards x k, ...] arrays, in two shapes at most:
    k = rows_per_shard while every shard has that many rows left, then k = 1 for the rest, so
    a minibatch's last rows do not ride in a micro-batch of mostly empty rows. Rows are
    balanced over shards by tokens (`balance_rows`); micro-batch i holds the next k rows of
    each shard's list, shard s in rows [s·k, (s+1)·k) (rows shard over devices in contiguous
    blocks). A shard short of rows gets empty ones (all zeros, segment 0: no loss, no
    gradient). Rows with no token at all are dropped first: they cost nothing. `plan`:
    (fewest, most) rows of a shard to cut by, when several processes must run the same
    sequence of shapes (`shard_rows` of each, the min of fewest and the max of most)."""
    seg = np.asarray(batch["segment_ids"])
    tokens = (seg > 0).sum(axis=1)
    live = np.flatnonzero(tokens > 0)
    per_shard = balance_rows(tokens[live], num_shards)
    fewest, most = plan if plan is not None else (min(len(p) for p in per_shard),
                                                 max(len(p) for p in per_shard))
    K = int(rows_per_shard)
    full = fewest // K                                  # micro-batches of K rows a shard
    sizes = [K] * full + [1] * (most - full * K)
    # With K > 1 a minibatch always ends in a one-row micro-batch (empty when the K-row ones
    # took every row), so the run's second shape compiles in its first step, not some later
    # one. With K = 1 there is one shape, and an empty micro-batch would only cost a row's
    # forward and backward. One micro-batch even of no rows.
    if not sizes or (K > 1 and most == full * K):
        sizes.append(1)
    out, at = [], 0
    for k in sizes:
        pick = np.full(num_shards * k, -1, np.int64)
        for s, rows in enumerate(per_shard):
            part = rows[at:at + k]
            pick[s * k:s * k + len(part)] = live[part]
        at += k
        mb = {}
        for key, x in batch.items():
            x = np.asarray(x)
            y = np.zeros((num_shards * k,) + x.shape[1:], x.dtype)
            y[pick >= 0] = x[pick[pick >= 0]]
            mb[key] = y
        out.append(mb)
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
         decreasing: bool = True, fit: str = "first",
         max_segments: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Packs ``prompts[i] + completions[i]`` into rows of `row_len` tokens.

    `seq_values[key][i]` is broadcast over sequence i; `token_values[key][i]` has one value per
    completion token of sequence i. A sequence longer than `row_len` is an error, or with
    `truncate` its completion (and its token values) is cut to fit, and counted. The number of
    rows is at least `min_rows`, rounded up to a multiple of `rows_multiple`.

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
        row, start = best_fit(p_len + c_len, row_len, max_segments=max_segments)
    elif fit == "first" and max_segments is None:
        row, start = first_fit(p_len + c_len, row_len, decreasing=decreasing)
    else:
        raise ValueError(f"pack: fit={fit!r} (max_segments only with fit='best'); choose "
                         "'first' or 'best'")
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
             decreasing: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`pack` for supervised fine-tuning: the loss covers the response tokens (which should
    end with the EOS token so the model learns to stop)."""
    return pack(prompts, responses, row_len, rows_multiple=rows_multiple, min_rows=min_rows,
                truncate=truncate, decreasing=decreasing)
