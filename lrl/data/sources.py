"""Random-access data sources (grain's `RandomAccessDataSource` protocol: `__len__`,
`__getitem__`) for jsonl files, parquet files and the synthetic tasks.

Every source yields examples of one shape, which the prompt pipeline consumes::

    {"messages": [{"role": ..., "content": ...}, ...],  # the chat, without the answer
     "prompt": str,            # the last user message, for logs and sample printouts
     "answer": str,            # the reference answer for the reward ("" when not configured)
     "task": str,              # names the reward/scorer (e.g. "math", "kv_retrieval")
     "metadata": dict}         # file and line (or row), plus any `metadata_fields`
    (+ "response": str when `response_field` is set: (prompt, response) records for SFT)

Rows come from `prompt_field` (a user message, with `system_prompt` put before it) or from
`messages_field` (a list of {"role", "content"}; `system_prompt` is prepended when the list has
no system message). The answer may be a string or a number (converted with `str`).

A malformed row (invalid JSON, not an object, missing field, wrong type) is reported with its
file and line (parquet: row) by `logging.warning`, skipped and counted in `num_malformed`; the
first few are logged one by one, then a summary. A missing file is a FileNotFoundError naming
it; a source with no valid row is a ValueError.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import threading
from typing import Any, Sequence

import numpy as np

from lrl.data import synthetic

_MAX_LOGGED = 20


class _BadRow(Exception):
    pass


def _expand(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in map(os.fspath, paths):
        if glob.has_magic(p):
            matches = sorted(glob.glob(p))
            if not matches:
                raise FileNotFoundError(f"no data file matches {p!r}")
            out.extend(matches)
        elif not os.path.isfile(p):
            raise FileNotFoundError(f"data file {p!r} does not exist")
        else:
            out.append(p)
    if not out:
        raise ValueError("no data files given")
    return out


class _Fields:
    """Turns one row (a dict) into an example, or raises _BadRow saying what is wrong."""

    def __init__(self, prompt_field: str, answer_field: str | None, messages_field: str | None,
                 system_prompt: str | None, response_field: str | None, task: str,
                 metadata_fields: Sequence[str]):
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.messages_field, self.system_prompt = messages_field, system_prompt
        self.response_field, self.task = response_field, task
        self.metadata_fields = tuple(metadata_fields)

    @property
    def columns(self) -> list[str]:
        cols = [self.messages_field or self.prompt_field, self.answer_field, self.response_field]
        return [c for c in dict.fromkeys(cols + list(self.metadata_fields)) if c is not None]

    def _get(self, row: dict, field: str) -> Any:
        if field not in row or row[field] is None:
            raise _BadRow(f"missing field {field!r}")
        return row[field]

    def example(self, row: Any, where: dict) -> dict[str, Any]:
        if not isinstance(row, dict):
            raise _BadRow(f"row is a {type(row).__name__}, not an object")
        if self.messages_field:
            messages = self._get(row, self.messages_field)
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages):
                raise _BadRow(f"field {self.messages_field!r} is not a non-empty list of "
                              "{'role': str, 'content': str}")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            prompt = self._get(row, self.prompt_field)
            if not isinstance(prompt, str):
                raise _BadRow(f"field {self.prompt_field!r} is a {type(prompt).__name__}, "
                              "not a string")
            messages = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        users = [m["content"] for m in messages if m["role"] == "user"]
        ex = {"messages": messages, "prompt": users[-1] if users else messages[-1]["content"],
              "answer": "", "task": self.task,
              "metadata": {**where, **{f: row.get(f) for f in self.metadata_fields}}}
        if self.answer_field is not None:
            answer = self._get(row, self.answer_field)
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise _BadRow(f"field {self.answer_field!r} is a {type(answer).__name__}, "
                              "not a string or number")
            ex["answer"] = str(answer)
        if self.response_field is not None:
            response = self._get(row, self.response_field)
            if not isinstance(response, str):
                raise _BadRow(f"field {self.response_field!r} is a "
                              f"{type(response).__name__}, not a string")
            ex["response"] = response
        return ex


class _FileSource:
    """Shared bookkeeping: malformed rows, the empty check, repr."""

    def __init__(self, paths, prompt_field="prompt", answer_field="answer",
                 messages_field=None, system_prompt=None, response_field=None, task="math",
                 metadata_fields=()):
        self.paths = _expand(paths)
        self.fields = _Fields(prompt_field, answer_field, messages_field, system_prompt,
                              response_field, task, metadata_fields)
        self.malformed: list[tuple[str, int, str]] = []  # (file, line or row, reason)

    @property
    def num_malformed(self) -> int:
        return len(self.malformed)

    def _bad(self, path: str, where: str, number: int, reason: str) -> None:
        self.malformed.append((path, number, reason))
        if len(self.malformed) <= _MAX_LOGGED:
            logging.warning("skipping malformed row %s:%s %d: %s", path, where, number, reason)

    def _finish(self, n: int) -> None:
        if len(self.malformed) > _MAX_LOGGED:
            logging.warning("skipped %d malformed rows in total in %s (first %d logged above)",
                            len(self.malformed), self.paths, _MAX_LOGGED)
        if n == 0:
            raise ValueError(f"no valid rows in {self.paths} ({self.num_malformed} malformed; "
                             f"fields: {self.fields.columns})")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(paths={self.paths}, len={len(self)}, "
                f"malformed={self.num_malformed})")


class JsonlSource(_FileSource):
    """Rows of jsonl files. Each file is read once at construction to validate the rows and
    index their byte offsets; `__getitem__` then reads one line with `os.pread`, which is
    safe from grain's reader threads."""

    def __init__(self, paths, **fields):
        super().__init__(paths, **fields)
        file_ids, offsets, sizes, lines = [], [], [], []
        for f, path in enumerate(self.paths):
            with open(path, "rb") as fh:
                offset = 0
                for lineno, raw in enumerate(fh, start=1):
                    size = len(raw)
                    if raw.strip():
                        try:
                            self.fields.example(json.loads(raw), {})
                        except (ValueError, _BadRow) as e:  # JSONDecodeError is a ValueError
                            self._bad(path, "line", lineno, str(e))
                        else:
                            file_ids.append(f)
                            offsets.append(offset)
                            sizes.append(size)
                            lines.append(lineno)
                    offset += size
        self._file_ids = np.asarray(file_ids, np.int32)
        self._offsets = np.asarray(offsets, np.int64)
        self._sizes = np.asarray(sizes, np.int64)
        self._lines = np.asarray(lines, np.int64)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._finish(len(self._offsets))

    def __len__(self) -> int:
        return len(self._offsets)

    def _fd(self, f: int) -> int:
        with self._lock:
            if f not in self._fds:
                self._fds[f] = os.open(self.paths[f], os.O_RDONLY)
            return self._fds[f]

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"JsonlSource index {index} out of range [0, {len(self)})")
        f = int(self._file_ids[index])
        raw = os.pread(self._fd(f), int(self._sizes[index]), int(self._offsets[index]))
        where = {"file": self.paths[f], "line": int(self._lines[index])}
        return self.fields.example(json.loads(raw), where)

    def __getstate__(self):  # file descriptors do not cross processes
        state = dict(self.__dict__)
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self, _close=os.close):  # bound early: `os` may be gone at interpreter exit
        for fd in getattr(self, "_fds", {}).values():
            _close(fd)


class ParquetSource(_FileSource):
    """Rows of parquet files; the configured columns are loaded into memory once."""

    def __init__(self, paths, **fields):
        import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

        super().__init__(paths, **fields)
        self._examples: list[dict[str, Any]] = []
        for path in self.paths:
            names = pq.read_schema(path).names
            missing = [c for c in self.fields.columns if c not in names]
            if missing:
                raise ValueError(f"parquet file {path!r} has no column(s) {missing}; "
                                 f"it has {names}")
            columns = pq.read_table(path, columns=self.fields.columns).to_pydict()
            for i in range(len(next(iter(columns.values())))):
                row = {c: v[i] for c, v in columns.items()}
                try:
                    ex = self.fields.example(row, {"file": path, "row": i})
                except _BadRow as e:
                    self._bad(path, "row", i, str(e))
                else:
                    self._examples.append(ex)
        self._finish(len(self._examples))

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._examples[int(index)]


def file_source(paths, **fields) -> JsonlSource | ParquetSource:
    """A `JsonlSource` or `ParquetSource` chosen by the files' extension (.jsonl/.json or
    .parquet); `fields` are the keyword arguments of either."""
    files = _expand(paths)
    kinds = {".parquet" if f.endswith(".parquet") else ".jsonl" if f.endswith((".jsonl", ".json"))
             else f for f in files}
    if kinds == {".parquet"}:
        return ParquetSource(files, **fields)
    if kinds == {".jsonl"}:
        return JsonlSource(files, **fields)
    raise ValueError(f"data files must all be .jsonl/.json or all .parquet, got {sorted(kinds)}")


class SyntheticSource:
    """`size` examples of a synthetic task (see lrl.data.synthetic), computed on access.
    With `sft`, each example also carries its ``"response"`` in the documented format."""

    def __init__(self, task: str, size: int, seed: int = 0, sft: bool = False,
                 think: bool = True, answer_noise: float = 0.0, **task_kwargs):
        if task not in synthetic.TASKS:
            raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(synthetic.TASKS)}")
        if size < 1:
            raise ValueError(f"SyntheticSource: size={size} must be >= 1")
        self.task, self.size, self.seed = task, int(size), int(seed)
        self.sft, self.think, self.task_kwargs = sft, think, task_kwargs
        self.answer_noise = float(answer_noise)
        self.num_malformed = 0
        synthetic.make_example(task, seed, 0, **task_kwargs)  # bad kwargs fail here, not later

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        if not 0 <= index < self.size:
            raise IndexError(f"SyntheticSource index {index} out of range [0, {self.size})")
        if self.sft:
            return synthetic.sft_example(self.task, self.seed, index, think=self.think,
                                         answer_noise=self.answer_noise, **self.task_kwargs)
        return synthetic.make_example(self.task, self.seed, index, **self.task_kwargs)

    def __repr__(self) -> str:
        return (f"SyntheticSource(task={self.task!r}, size={self.size}, seed={self.seed}, "
                f"{self.task_kwargs})")
