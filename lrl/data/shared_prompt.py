"""The shared-prompt layout of update rows: a group's prompt once, then its responses.

B batch rows · T positions in a row · G samples per prompt.

Under one set of parameters a prompt's hidden states are the same for each of its G samples,
and the policy loss reads only response tokens, so the update may compute the prompt once per
row instead of once per sample. A shared group in a row is

    [ prompt[:-1] ] [ prompt[-1], c_1 ] [ prompt[-1], c_2 ] ... [ prompt[-1], c_k ]
      the prefix      response 1          response 2              response k

The prompt's last token opens every response segment: its hidden state predicts the
response's first token, and each response needs its own target there. That costs one token
a response and keeps one target per position, which is what the fused lm head and the losses
take. Every segment has its own segment id, so the loss sees each response as its own
sequence (sequence counts, seq_mean_token_mean, GSPO's per-sequence means) and the prefix,
which has no loss token, as no sequence: `lrl.rl.losses` and `host_denominators` run
unchanged. Positions continue from the prompt's end: response g holds positions p-1, p, ...,
p-1+len(c_g), exactly those of the unshared sequence. Attention reads one more array,

  prefix_ids  int32 [B, T]  the segment id of the shared prefix a token reads: a prefix
                            token's own segment id, a response token's prefix's; 0 elsewhere
                            (unshared sequences and padding)

with which a response token sees its own segment causally and its prefix fully, and a prefix
token only its prefix, causally (`lrl.models.shared_attention`).

`pack_groups` is `lrl.data.packing.pack` with this layout for the sequences whose `share`
flag is set (all of a group's or none); the others are packed exactly as `pack` packs them,
and a group with one sequence (or one response in a row) is always packed so. A group whose
prompt and responses do not fit one row is split into chunks of responses, each in a row of
its own with a copy of the prefix: the prompt is then computed once per chunk. No unit spans
rows, so a shared group's prefix and its responses always lie in one row, the prefix first
and the responses right after it, and segment (so prefix) ids increase along a row: the
prefix block's cuDNN runs (`lrl.models.flash_cudnn.CrossRuns`) rely on the first two and
match groups by id, not on the third. `share_groups` is the rule of `rl.shared_prompt`
(off / on / auto).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from lrl.data import packing

MODES = ("off", "on", "auto")


def share_groups(groups: Sequence[int], prompt_lens: Sequence[int],
                 completion_lens: Sequence[int], mode: str) -> np.ndarray:
    """[n] bool: which sequences share their group's prompt. "on": every group of two or more
    sequences whose prompt has two or more tokens (a one-token prompt has no prefix to share);
    "auto": those whose prompt is also longer than the group's mean response (the tokens the
    update no longer repeats outweigh the response-to-prompt attention block); "off": none."""
    if mode not in MODES:
        raise ValueError(f"rl.shared_prompt={mode!r}; choose one of {MODES}")
    groups = np.asarray(groups)
    p, c = np.asarray(prompt_lens, np.float64), np.asarray(completion_lens, np.float64)
    out = np.zeros(groups.size, bool)
    if mode == "off":
        return out
    for g in np.unique(groups):
        members = groups == g
        ok = members.sum() >= 2 and p[members].min() >= 2
        if mode == "auto":
            ok = ok and p[members].mean() > c[members].mean()
        out[members] = ok
    return out


def _chunks(p: int, comp_lens: Sequence[int], row_len: int, max_segments: int | None):
    """A shared group's responses (indices into comp_lens) cut greedily, in order, into
    chunks that each fit one row with the prefix: (p - 1) + sum(1 + c) tokens and 1 + k
    segments at most."""
    out, cur, used = [], [], p - 1
    for j, c in enumerate(comp_lens):
        fits = used + 1 + c <= row_len and (max_segments is None or len(cur) + 2 <= max_segments)
        if cur and not fits:
            out.append(cur)
            cur, used = [], p - 1
        cur.append(j)
        used += 1 + c
    if cur:
        out.append(cur)
    return out


def pack_groups(prompts: Sequence[Any], completions: Sequence[Any], row_len: int, *,
                groups: Sequence[int], share: Sequence[bool],
                seq_values: Mapping[str, Sequence[float]] | None = None,
                token_values: Mapping[str, Sequence[Any]] | None = None,
                rows_multiple: int = 1, min_rows: int = 0, truncate: bool = False,
                max_segments: int | None = None,
                cut: packing.Cut | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """`packing.pack(..., fit="best")` with the shared-prompt layout for the sequences whose
    `share[i]` is set: sequences of one `groups[i]` share one prompt (their prompts must be
    equal). Returns (batch, layout): batch as `pack`'s plus ``prefix_ids``; layout as
    `pack`'s, where for a shared sequence ``start`` is its response segment, ``loss_start``
    the same (the position whose target is its first completion token) and ``prefix_start``
    its prefix (-1 for an unshared sequence). With no `share` set, the arrays `pack` returns
    are returned unchanged, and ``prefix_ids`` is all 0."""
    seq_values, token_values = dict(seq_values or {}), dict(token_values or {})
    n = len(prompts)
    groups, share = np.asarray(groups), np.asarray(share, bool)
    if groups.shape != (n,) or share.shape != (n,):
        raise ValueError(f"pack_groups: groups {groups.shape} and share {share.shape} must "
                         f"have one entry per sequence ({n})")
    p_ids, c_ids, tok_vals, num_truncated, truncated_tokens = packing.checked_sequences(
        prompts, completions, row_len, seq_values, token_values, rows_multiple=rows_multiple,
        min_rows=min_rows, truncate=truncate, reserved=("prefix_ids",))
    p_len = np.array([len(x) for x in p_ids], np.int64)
    c_len = np.array([len(x) for x in c_ids], np.int64)

    # Units: an unshared sequence, or one chunk of a shared group's responses, in the order
    # of their first sequence (so with nothing shared the units are `pack`'s sequences).
    members_of: dict = {}
    for i in np.flatnonzero(share):
        members_of.setdefault(groups[i], []).append(int(i))
    units: list[tuple[list[int], bool]] = []
    for i in range(n):
        if not share[i]:
            if groups[i] in members_of:
                raise ValueError(f"pack_groups: group {groups[i]} has shared and unshared "
                                 "sequences")
            units.append(([i], False))
            continue
        members = members_of[groups[i]]
        if i != members[0]:
            continue
        for j in members[1:]:
            if not np.array_equal(p_ids[j], p_ids[i]):
                raise ValueError(f"pack_groups: sequences {i} and {j} of group {groups[i]} "
                                 "have different prompts")
        for chunk in _chunks(int(p_len[i]), [int(c_len[j]) for j in members], row_len,
                             max_segments):
            # one response in a row shares nothing: it is packed as `pack` packs it
            units.append(([members[j] for j in chunk], len(chunk) > 1))
    lengths = [int(p_len[u[0]] + c_len[u[0]]) if not sh else
               int(p_len[u[0]] - 1 + sum(1 + c_len[j] for j in u)) for u, sh in units]
    segments = [1 + len(u) if sh else 1 for u, sh in units]
    if max_segments is not None and max_segments < 2 and any(sh for _, sh in units):
        raise ValueError(f"pack_groups: max_segments={max_segments}; a shared group needs 3")
    row, start = packing.best_fit(lengths, row_len, max_segments=max_segments,
                                  segments=segments, cut=cut)
    num_rows = max(int(row.max()) + 1 if units else 0, min_rows)
    num_rows = -(-num_rows // rows_multiple) * rows_multiple

    shape = (num_rows, row_len)
    batch = {"tokens": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
             "segment_ids": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
             "loss_mask": np.zeros(shape, np.float32), "prefix_ids": np.zeros(shape, np.int32)}
    for key in list(seq_values) + list(tok_vals):
        batch[key] = np.zeros(shape, np.float32)
    lay = {k: np.full(n, -1, np.int64) for k in ("row", "start", "loss_start", "prefix_start")}
    next_id = np.zeros(num_rows, np.int32)

    def segment(r, s, tokens, positions):
        """Writes one segment at [s, s + len) of row r -> its id."""
        next_id[r] += 1
        sl = slice(s, s + len(tokens))
        batch["tokens"][r, sl] = tokens
        batch["positions"][r, sl] = positions
        batch["segment_ids"][r, sl] = next_id[r]
        batch["targets"][r, s:s + len(tokens) - 1] = tokens[1:]
        return int(next_id[r]), sl

    def sequence_values(i, r, s, length, a):
        """Sequence i's loss mask and values on its segment [s, s + length), whose positions
        from `a` on have its completion tokens as targets."""
        c = int(c_len[i])
        batch["loss_mask"][r, a:a + c] = 1.0
        for key, vals in seq_values.items():
            batch[key][r, s:s + length] = vals[i]
        for key, vs in tok_vals.items():
            batch[key][r, a:a + c] = vs[i]
        lay["row"][i], lay["start"][i], lay["loss_start"][i] = r, s, a

    for u in np.lexsort((start, row)):  # row by row, left to right: segment ids 1, 2, ...
        members, shared = units[u]
        r, s = int(row[u]), int(start[u])
        i0 = members[0]
        p = int(p_len[i0])
        if not shared:
            seq = np.concatenate([p_ids[i0], c_ids[i0]])
            segment(r, s, seq, np.arange(len(seq), dtype=np.int32))
            sequence_values(i0, r, s, len(seq), s + p - 1)
            continue
        pid, sl = segment(r, s, p_ids[i0][:-1], np.arange(p - 1, dtype=np.int32))
        batch["prefix_ids"][r, sl] = pid
        at = s + p - 1
        for i in members:
            seq = np.concatenate([p_ids[i0][-1:], c_ids[i]])
            _, sl = segment(r, at, seq, np.arange(p - 1, p - 1 + len(seq), dtype=np.int32))
            batch["prefix_ids"][r, sl] = pid
            sequence_values(i, r, at, len(seq), at)
            lay["prefix_start"][i] = s
            at += len(seq)

    layout = {**lay, "prompt_len": p_len, "completion_len": c_len,
              "num_truncated": num_truncated, "truncated_tokens": truncated_tokens, "seq_keys": tuple(seq_values),
              "token_keys": tuple(tok_vals), "shared": share & (lay["prefix_start"] >= 0)}
    return batch, layout
