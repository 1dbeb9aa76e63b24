"""The start-up checks of the data (`lrl.preflight`): the training, held-out and SFT rows,
read only until enough usable ones are found, with the malformed rows met on the way counted
and the first listed; then, once the tokenizer has loaded, the same counting only prompts
within `data.max_prompt_len` tokens.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from lrl.errors import UserError
from lrl.preflight import _MAX_LISTED, check

@dataclasses.dataclass
class Scan:
    """What reading a dataset's first rows found."""
    usable: int = 0          # valid rows within the length limit
    too_long: int = 0        # valid rows over it
    malformed: list = dataclasses.field(default_factory=list)   # "file:line: reason"
    rows: int = 0            # rows read
    first: str = ""          # where the first usable row is


def _rows(paths: list[str], columns: list[str]):
    """(where, row) of jsonl or parquet files, read lazily; a row that is not JSON is
    (where, ValueError)."""
    for path in paths:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            try:
                pf = pq.ParquetFile(path)
                names = pf.schema_arrow.names
            except Exception as e:  # noqa: BLE001 -- pyarrow's errors for a bad file vary
                raise UserError(f"not a readable parquet file ({e})", path,
                                "write it again, or convert it to jsonl") from e
            lost = [c for c in columns if c not in names]
            if lost:
                raise UserError(f"no column(s) {lost}; it has {names}", path,
                                "set data.prompt_field / data.answer_field (or "
                                "data.messages_field, sft.response_field) to its columns")
            for batch in pf.iter_batches(batch_size=256, columns=columns):
                for i, row in enumerate(batch.to_pylist()):
                    yield f"{path} row {i}", row
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    try:
                        yield f"{path}:{lineno}", json.loads(raw)
                    except ValueError as e:   # JSONDecodeError and UnicodeDecodeError
                        yield f"{path}:{lineno}", ValueError(f"not JSON: {e}")


def scan(paths: list[str], parse: Callable[[object, str], dict], want: int,
         fits: Callable[[dict], bool] = lambda ex: True, columns=()) -> Scan:
    """Reads rows until `want` usable ones are found (or the data ends). `parse(row, where)`
    raises ValueError for a malformed row."""
    s = Scan()
    for where, row in _rows(paths, list(columns)):
        s.rows += 1
        try:
            if isinstance(row, ValueError):
                raise row
            ex = parse(row, where)
        except ValueError as e:
            s.malformed.append(f"{where}: {e}")
            continue
        if not fits(ex):
            s.too_long += 1
            continue
        s.usable += 1
        s.first = s.first or where
        if s.usable >= want:
            break
    return s


def _text_parse(opts, response: bool = False):
    from lrl.data import sources
    d = opts.data
    fields = sources._Fields(d.prompt_field, d.answer_field or None,  # noqa: SLF001
                             d.messages_field or None, d.system_prompt or None,
                             opts.sft.response_field if response else None, "task", ())

    def parse(row, where):
        try:
            return fields.example(row, {})
        except sources._BadRow as e:  # noqa: SLF001
            raise ValueError(str(e)) from None
    return parse, fields.columns


def _fits(ctx):
    """Whether a text example's rendered prompt is within data.max_prompt_len tokens."""
    tok, n = ctx.tokenizer(), ctx.opts.data.max_prompt_len
    if tok is None:
        return lambda ex: True
    from lrl.data import prompts
    limit = prompts.max_chars(tok, n)

    def fits(ex):
        text = prompts.render_prompt(tok, ex["messages"])
        return len(text) <= limit and len(prompts._encode(tok, text)) <= n  # noqa: SLF001
    return fits


def _files(key: str, paths: str) -> list[str]:
    from lrl.data import sources
    try:
        files = sources._expand([p.strip() for p in paths.split(",") if p.strip()])  # noqa: SLF001
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e), f"config key {key}", f"point --config.{key}=... at existing "
                        "files") from e
    kinds = {os.path.splitext(f)[1] for f in files}
    if not (kinds <= {".jsonl", ".json"} or kinds == {".parquet"}):
        raise UserError(f"data files must all be .jsonl/.json or all .parquet, got "
                        f"{sorted(kinds)}", f"config key {key}", "convert them to one format")
    return files


def _fail(key: str, files: list[str], s: Scan, need: int, what: str, todo: str):
    place = files[0] if len(files) == 1 else f"{key} ({len(files)} files)"
    if s.rows == 0:
        raise UserError(f"{what} is empty: no rows", place, f"point --config.{key} at the "
                        "data, or check that the file was written")
    if s.usable == 0 and s.too_long == 0:
        raise UserError(f"{what} has no usable row: all {s.rows} rows read are malformed",
                        place, todo, details=s.malformed[:_MAX_LISTED])
    if s.usable == 0:
        raise UserError(f"{what} has no usable row: {s.too_long} valid rows, all longer "
                        f"than data.max_prompt_len={need} tokens"
                        + (f" ({len(s.malformed)} malformed)" if s.malformed else ""), place,
                        "raise --config.data.max_prompt_len", details=s.malformed[:2])


def _check_text_data(ctx, key: str, paths: str, what: str, need: int, response=False,
                     length=False) -> tuple[str, Scan]:
    files = _files(key, paths)
    parse, columns = _text_parse(ctx.opts, response)
    s = scan(files, parse, need, _fits(ctx) if length else (lambda ex: True), columns)
    d = ctx.opts.data
    fields = ([f"data.messages_field={d.messages_field!r}"] if d.messages_field
              else [f"data.prompt_field={d.prompt_field!r}"])
    if d.answer_field:
        fields.append(f"data.answer_field={d.answer_field!r}")
    if response:
        fields.append(f"sft.response_field={ctx.opts.sft.response_field!r}")
    todo = f"each row needs the fields {', '.join(fields)}: fix the rows or set those keys"
    _fail(key, files, s, d.max_prompt_len, what, todo)
    return (f"{key}: usable rows from {s.first}"
            + (f", {len(s.malformed)} malformed before" if s.malformed else "")), s


def _check_video_data(ctx, key: str, paths: str, what: str, need: int) -> str:
    from lrl.tasks import video_data
    files = _files(key, paths)
    d = video_data.QAFields.of(ctx.opts)

    def parse(row, where):
        if not isinstance(row, dict):
            raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
        path = where.rsplit(":", 1)[0]
        rec = video_data._qa_record(row, d, where, os.path.dirname(os.path.abspath(path)))  # noqa: SLF001
        if not os.path.isfile(rec["video"]):
            raise ValueError(f"video file not found: {rec['video']}")
        return rec
    s = scan(files, parse, need)
    _fail(key, files, s, ctx.opts.data.max_prompt_len, what,
          f"each row needs video.video_field={d.video_field!r}, data.prompt_field="
          f"{d.prompt_field!r} and data.answer_field={d.answer_field!r}, its video file "
          "existing (relative paths: against video.video_root or the jsonl's folder)")
    return f"{key}: usable rows from {s.first}"


@check("data", after="config")
def _data(ctx, length=False):
    o = ctx.opts
    if o.data.source == "synthetic":
        return None
    if o.task == "video":
        return _check_video_data(ctx, "data.paths", o.data.paths, "the training data", 1)
    return _check_text_data(ctx, "data.paths", o.data.paths, "the training data", 1,
                            length=length)[0]


@check("eval_data", after="data")
def _eval_data(ctx, length=False):
    o = ctx.opts
    if not o.eval.every or o.job != "grpo":
        return None
    if o.data.source == "synthetic":
        need = 1 if o.task == "video" else o.eval.num_prompts
        if o.data.eval_size < need:
            raise UserError(f"data.eval_size={o.data.eval_size} held-out examples make no eval "
                            f"batch of eval.num_prompts={o.eval.num_prompts}",
                            "config key data.eval_size",
                            f"set it to at least {need}, or eval.every=0 for no eval")
        return None
    if not o.data.eval_paths:
        return None
    if o.task == "video":
        return _check_video_data(ctx, "data.eval_paths", o.data.eval_paths,
                                 "the held-out data", 1)
    # The eval reads one pass and drops an incomplete last batch: one full batch at least.
    note, s = _check_text_data(ctx, "data.eval_paths", o.data.eval_paths, "the held-out data",
                               o.eval.num_prompts, length=length)
    if s.usable < o.eval.num_prompts:
        raise UserError(f"the held-out data has {s.usable} usable rows, fewer than "
                        f"eval.num_prompts={o.eval.num_prompts}: no eval batch would run"
                        + (f" ({len(s.malformed)} malformed, {s.too_long} over "
                           "data.max_prompt_len)" if s.malformed or s.too_long else ""),
                        "config key data.eval_paths",
                        f"lower --config.eval.num_prompts to {s.usable} or less, add rows, or "
                        "set eval.every=0", details=s.malformed[:_MAX_LISTED])
    return note


@check("sft_data", after="eval_data")
def _sft_data(ctx):
    o = ctx.opts
    if o.task != "text" or not o.sft.steps or not o.sft.paths:
        return None
    return _check_text_data(ctx, "sft.paths", o.sft.paths, "the SFT data", 1,
                            response=True)[0]


@check("prompt_lengths", after="resume")
def _prompt_lengths(ctx):
    """The data checks again, counting only prompts within data.max_prompt_len tokens: after
    the tokenizer's, so that a data file's own faults are found before transformers loads."""
    o = ctx.opts
    if o.task != "text" or o.data.source == "synthetic" or ctx.tokenizer() is None:
        return None
    _data(ctx, length=True)
    _eval_data(ctx, length=True)
    return f"prompts within data.max_prompt_len={o.data.max_prompt_len}"
