"""The prompt pipeline (grain) for RL, and the packed-batch pipeline for SFT.

P prompts (per process and batch) · T query positions (of a packed row).

`PromptIterator` reads a random-access source (lrl.data.sources) through grain:

  MapDataset.source -> shuffle(seed) -> repeat(num_epochs)     (a new order every epoch)
    -> [process_index::process_count]                          (disjoint per-process shards)
    -> map(tokenize through the chat template)                 (grain reader threads)
       (a prompt of more characters than max_prompt_len tokens can cover is not tokenized)
    -> drop prompts longer than max_prompt_len, COUNTED and the first ones logged
    -> batches of P, ordered so each of `num_data_shards` consecutive blocks of P / shards
       prompts has a close token total (the rollout gives block d to data shard d)

and its state (`get_state` / `set_state`, plain JSON-able ints) resumes at the exact prompt.
A batch is a dict: ``prompt_ids`` (list of int32 arrays), ``num_tokens`` int32 [P],
``answer``/``task``/``prompt``/``metadata``/``messages`` (lists; metadata gains ``epoch`` and
``sample_index``, the position in the shuffled stream), ``shard_tokens`` int64
[num_data_shards] (prompt tokens per data shard), in balanced order.

`SFTIterator` reads (prompt, response) records the same way and yields fixed-shape packed
batches (lrl.data.packing) of exactly `rows` rows of `row_len` tokens.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import grain
import numpy as np

from lrl.data import packing


def render_prompt(tokenizer, messages: list[dict], chat_template: bool = True) -> str:
    """The text the model sees before its answer: the chat template with the assistant turn
    opened, or (for base models without a template) the message contents joined."""
    if not chat_template:
        return "\n\n".join(m["content"] for m in messages) + "\n\n"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no "
                         "chat_template; use chat_template=False to feed raw text")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


# A Unicode normaliser (NFC, as Qwen's tokenizer has) may compose up to 4 code points into
# one (the longest canonical decomposition in Unicode has 4), shrinking the text it tokenizes.
_NORMALISER_SLACK = 4
_MAX_LOGGED = 20


def max_chars(tokenizer, max_tokens: int) -> int:
    """Characters above which a text surely has more than `max_tokens` tokens: no token covers
    more characters than its vocabulary string (a byte-level BPE string has one character per
    byte), times the normaliser slack. Longer texts are dropped without being tokenized: the
    tokenizer took 5 s on one 4 MB prompt, and minutes on a 120 MB jsonl line."""
    return max_tokens * max(len(t) for t in tokenizer.get_vocab()) * _NORMALISER_SLACK


def tokenize_prompt(tokenizer, messages: list[dict], chat_template: bool = True) -> np.ndarray:
    """Token ids (int32) of the rendered prompt."""
    return _encode(tokenizer, render_prompt(tokenizer, messages, chat_template))


def tokenize_sft(tokenizer, example: dict[str, Any],
                 chat_template: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, response ids + EOS) of an SFT record, the EOS being what the rollout
    stops on, so the warm start teaches the model to stop."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token")
    response = _encode(tokenizer, example["response"])
    return (tokenize_prompt(tokenizer, example["messages"], chat_template),
            np.append(response, np.int32(tokenizer.eos_token_id)).astype(np.int32))


def response_train_mask(tokenizer, example: dict[str, Any],
                        response_ids: np.ndarray) -> Optional[np.ndarray]:
    """1.0 on the response ids (of `tokenize_sft`, EOS included) the SFT loss trains, 0.0 on
    the rest, from the record's ``response_segments`` ((text, trained) pieces: a multi-turn
    demonstration's tool responses are read, not predicted); None when it has none (all
    trained). Pieces that tokenize otherwise than the whole response are an error."""
    segments = example.get("response_segments")
    if segments is None:
        return None
    ids = [_encode(tokenizer, text) for text, _ in segments]
    if not np.array_equal(np.concatenate(ids + [response_ids[-1:]]), response_ids):
        raise ValueError(f"SFT record {example.get('metadata')}: its response_segments "
                         "tokenize otherwise than its response (cut them at special tokens)")
    mask = [np.full(len(x), float(trained), np.float32) for x, (_, trained) in zip(ids, segments)]
    return np.concatenate(mask + [np.ones(1, np.float32)])   # the EOS is trained


def balance_shards(num_tokens, num_shards: int) -> np.ndarray:
    """A permutation of the P prompts such that consecutive blocks of P / num_shards have close
    token totals: longest first, each to the lightest shard that still has room."""
    num_tokens = np.asarray(num_tokens, np.int64)
    if num_shards < 1 or num_tokens.size % num_shards:
        raise ValueError(f"balance_shards: {num_tokens.size} prompts do not divide over "
                         f"{num_shards} data shards")
    per_shard = num_tokens.size // num_shards
    totals = np.zeros(num_shards, np.int64)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for i in np.argsort(-num_tokens, kind="stable"):
        open_ = [d for d in range(num_shards) if len(members[d]) < per_shard]
        d = min(open_, key=lambda d: (totals[d], d))
        members[d].append(int(i))
        totals[d] += num_tokens[i]
    # Within a shard the prompts keep their (shuffled) reading order.
    return np.asarray([i for m in members for i in sorted(m)], np.int64)


def _grain_dataset(source, seed: int, num_epochs: int | None, process_index: int,
                   process_count: int, tokenize) -> grain.MapDataset:
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    n = len(source)
    if n == 0:
        raise ValueError(f"data source {source!r} is empty")
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(num_epochs)
    # The global index (before sharding) gives the epoch; every process uses the same
    # permutation and takes every process_count-th element, so shards are disjoint.
    ds = ds.map_with_index(lambda i, ex: (i, ex))[process_index::process_count]
    return ds.map(lambda t: {**tokenize(t[1]), "sample_index": t[0], "epoch": t[0] // n})


class _GrainIterator:
    """Shared state handling: the grain iterator plus our own counters."""

    def __init__(self, source, seed, num_epochs, process_index, process_count, tokenize,
                 num_threads, prefetch, config):
        self.source = source
        ds = _grain_dataset(source, seed, num_epochs, process_index, process_count, tokenize)
        self._iter = iter(ds.to_iter_dataset(
            grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)))
        self._config = {"seed": seed, "process_index": process_index,
                        "process_count": process_count, **config}
        self._shard_len = -(-len(source) // process_count)
        self._counters = {"seen": 0, "dropped_too_long": 0, "batches": 0, "epoch": 0}
        self._logged_drops = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def _next_record(self) -> dict[str, Any]:
        rec = next(self._iter)
        self._counters["seen"] += 1
        self._counters["epoch"] = int(rec["epoch"])
        return rec

    def _dropped(self, consecutive: int, what: str, rec=None, size: str = "") -> None:
        self._counters["dropped_too_long"] += 1
        if rec is not None and self._logged_drops < _MAX_LOGGED:
            self._logged_drops += 1
            where = rec["metadata"]
            place = (f"{where['file']} line {where['line']}" if "line" in where else
                     f"{where['file']} row {where['row']}" if "row" in where else str(where))
            logging.warning("dropping %s: %s, over %s%s", place, size, what,
                            "" if self._logged_drops < _MAX_LOGGED else
                            " (further drops are only counted, in data/dropped_too_long)")
        if consecutive > self._shard_len:  # a whole pass without one usable record
            raise ValueError(f"every record of {self.source!r} is over the length limit "
                             f"({what})")

    def _resume_point(self) -> tuple[dict[str, Any], int]:
        """The grain state to restore and how many records read so far it will read again."""
        return self._iter.get_state(), 0

    def get_state(self) -> dict[str, Any]:
        grain_state, unread = self._resume_point()
        counters = {k: int(v) for k, v in self._counters.items()}
        counters["seen"] -= unread
        return {"grain": grain_state, "config": dict(self._config), **counters}

    def set_state(self, state: dict[str, Any]) -> None:
        if state["config"] != self._config:
            raise ValueError(f"data iterator state was saved with {state['config']}, "
                             f"but this iterator is {self._config}")
        self._iter.set_state(state["grain"])
        self._counters = {k: int(state[k]) for k in self._counters}

    def stats(self) -> dict[str, int]:
        """Counters for the metrics: records read and dropped as too long, batches, epoch,
        malformed rows skipped by the source."""
        return {"data/seen": self._counters["seen"],
                "data/dropped_too_long": self._counters["dropped_too_long"],
                "data/batches": self._counters["batches"],
                "data/epoch": self._counters["epoch"],
                "data/malformed": int(getattr(self.source, "num_malformed", 0))}


class PromptIterator(_GrainIterator):
    """Batches of `batch_size` prompts for the rollout (see the module docstring).

    `process_index`/`process_count` are `jax.process_index()`/`jax.process_count()` in a real
    run. With `num_epochs=None` (training) it never ends; with a number, the last incomplete
    batch is dropped.
    """

    def __init__(self, source, tokenizer, *, batch_size: int, max_prompt_len: int,
                 seed: int = 0, num_epochs: int | None = None, process_index: int = 0,
                 process_count: int = 1, num_data_shards: int = 1, chat_template: bool = True,
                 num_threads: int = 1, prefetch: int = 16):
        if batch_size < 1 or batch_size % num_data_shards:
            raise ValueError(f"PromptIterator: batch_size={batch_size} must be a positive "
                             f"multiple of num_data_shards={num_data_shards}")
        render_prompt(tokenizer, [{"role": "user", "content": "x"}], chat_template)  # fail early

        limit = max_chars(tokenizer, max_prompt_len)

        def tokenize(ex):
            text = render_prompt(tokenizer, ex["messages"], chat_template)
            if len(text) > limit:  # surely too long: not tokenized, and not kept in memory
                return {"metadata": ex["metadata"], "num_chars": len(text), "num_tokens": None}
            ids = _encode(tokenizer, text)
            return {**ex, "prompt_ids": ids, "num_tokens": len(ids)}

        self.batch_size, self.max_prompt_len = batch_size, max_prompt_len
        self.num_data_shards = num_data_shards
        super().__init__(source, seed, num_epochs, process_index, process_count, tokenize,
                         num_threads, prefetch,
                         {"batch_size": batch_size, "max_prompt_len": max_prompt_len})

    def __next__(self) -> dict[str, Any]:
        records, consecutive = [], 0
        while len(records) < self.batch_size:
            rec = self._next_record()  # StopIteration ends a finite run
            if rec["num_tokens"] is None or rec["num_tokens"] > self.max_prompt_len:
                consecutive += 1
                size = (f"{rec['num_chars']} characters" if rec["num_tokens"] is None else
                        f"{rec['num_tokens']} tokens")
                self._dropped(consecutive, f"max_prompt_len={self.max_prompt_len}", rec, size)
                continue
            consecutive = 0
            records.append(rec)
        num_tokens = np.asarray([r["num_tokens"] for r in records], np.int32)
        order = balance_shards(num_tokens, self.num_data_shards)
        records = [records[i] for i in order]
        self._counters["batches"] += 1
        batch = {k: [r[k] for r in records]
                 for k in ("prompt_ids", "answer", "task", "prompt", "messages")}
        batch["metadata"] = [{**r["metadata"], "sample_index": r["sample_index"],
                              "epoch": r["epoch"]} for r in records]
        batch["num_tokens"] = num_tokens[order]
        batch["shard_tokens"] = batch["num_tokens"].reshape(self.num_data_shards, -1).sum(
            1, dtype=np.int64)
        return batch


class SFTIterator(_GrainIterator):
    """Packed SFT batches: dicts of `packing.sft_pack` arrays, each exactly [rows, row_len]
    (plus ``num_sequences``). Records are placed first-fit in reading order; the first record
    that fits in no row starts the next batch. A record longer than `row_len` is dropped and
    counted, or with `truncate` its response is cut."""

    def __init__(self, source, tokenizer, *, rows: int, row_len: int, seed: int = 0,
                 num_epochs: int | None = None, process_index: int = 0, process_count: int = 1,
                 truncate: bool = False, chat_template: bool = True, num_threads: int = 1,
                 prefetch: int = 16):
        if rows < 1 or row_len < 2:
            raise ValueError(f"SFTIterator: rows={rows} must be >= 1 and row_len={row_len} >= 2")

        limit = max_chars(tokenizer, row_len)

        def tokenize(ex):
            if "response" not in ex:
                raise ValueError(f"SFT record {ex.get('metadata')} has no 'response' "
                                 "(set response_field on the source)")
            # A prompt (or, not truncating, a record) past the character bound cannot fit a
            # row: dropped untokenized. A truncated response is tokenized whole.
            chars = len(render_prompt(tokenizer, ex["messages"], chat_template))
            if chars > limit or (not truncate and chars + len(ex["response"]) > limit):
                return {"prompt_ids": None, "num_chars": chars + len(ex["response"]),
                        "metadata": ex["metadata"]}
            p, r = tokenize_sft(tokenizer, ex, chat_template)
            return {"prompt_ids": p, "response_ids": r, "metadata": ex["metadata"],
                    "train_mask": response_train_mask(tokenizer, ex, r)}

        self.rows, self.row_len, self.truncate = rows, row_len, truncate
        self._pending: dict[str, Any] | None = None
        self._pending_state: dict[str, Any] | None = None
        super().__init__(source, seed, num_epochs, process_index, process_count, tokenize,
                         num_threads, prefetch,
                         {"rows": rows, "row_len": row_len, "truncate": truncate})

    def _fits(self, rec) -> bool:
        if rec["prompt_ids"] is None:
            return False
        p, r = len(rec["prompt_ids"]), len(rec["response_ids"])
        return p + r <= self.row_len or (self.truncate and p < self.row_len)

    def __next__(self) -> dict[str, Any]:
        chosen, used, consecutive = [], [], 0
        while True:
            if self._pending is None:
                state = self._iter.get_state()
                try:
                    rec = self._next_record()
                except StopIteration:
                    break
                if not self._fits(rec):
                    consecutive += 1
                    size = (f"{rec['num_chars']} characters" if rec["prompt_ids"] is None else
                            f"{len(rec['prompt_ids']) + len(rec['response_ids'])} tokens")
                    self._dropped(consecutive, f"row_len={self.row_len}", rec, size)
                    continue
                consecutive = 0
                self._pending, self._pending_state = rec, state
            rec = self._pending
            length = min(len(rec["prompt_ids"]) + len(rec["response_ids"]), self.row_len)
            free = [j for j, u in enumerate(used) if u + length <= self.row_len]
            if free:
                used[free[0]] += length
            elif len(used) < self.rows:
                used.append(length)
            else:
                break  # the pending record opens the next batch
            chosen.append(rec)
            self._pending = self._pending_state = None
        if not chosen:
            raise StopIteration
        # First fit in reading order places the records exactly as counted above.
        batch, layout = packing.sft_pack([r["prompt_ids"] for r in chosen],
                                         [r["response_ids"] for r in chosen], self.row_len,
                                         min_rows=self.rows, truncate=self.truncate,
                                         decreasing=False,
                                         train_masks=[r["train_mask"] for r in chosen])
        assert batch["tokens"].shape[0] == self.rows, batch["tokens"].shape
        self._counters["batches"] += 1
        batch["num_sequences"] = np.int32(len(chosen))
        batch["truncated_tokens"] = np.int32(layout["truncated_tokens"])
        return batch

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._pending = self._pending_state = None

    def _resume_point(self) -> tuple[dict[str, Any], int]:
        # A record read but not yet emitted is read again after a restore.
        if self._pending is not None:
            return self._pending_state, 1
        return self._iter.get_state(), 0
