"""The video task's data (`lrl.tasks.video`): the records (synthetic videos or a video-QA
jsonl), the batches of a step and the tokenizer with Qwen2.5-VL's vision tokens.

A record is `lrl.data.video_task`'s: {"messages", "prompt", "answer", "task", "video",
"metadata"}. A video-QA jsonl row holds a local video path, a question and an answer (field
names configurable), optionally a list of choices: the question then lists them as
"A. ...", "B. ..." and the answer becomes the option's letter (given as the letter or as the
option's text). Relative video paths are read against `video.video_root` or else the jsonl's
own directory. Malformed rows are reported by file and line, rows whose video file is missing
by file, line and path; both are skipped. Videos that exist but do not decode are reported by
path at the step that meets them and never tried again.

"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import NamedTuple, Optional

import numpy as np
from tokenizers import AddedToken

from lrl.data import video_task

log = logging.getLogger(__name__)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LETTERS = "ABCDEFGHIJ"


# ----------------------------------------------------------------------------- records

class QAFields(NamedTuple):
    """Which fields of a video-QA jsonl row hold what, and the instructions appended."""
    video_field: str
    prompt_field: str
    answer_field: str
    choices_field: str
    video_root: str
    instruction: str
    choice_instruction: str
    system_prompt: str

    @classmethod
    def of(cls, opts) -> "QAFields":
        v, d = opts.video, opts.data
        return cls(v.video_field, d.prompt_field, d.answer_field, v.choices_field,
                   v.video_root, v.instruction, v.choice_instruction, d.system_prompt)


def synthetic_records(opts, workdir: str, split: str = "train") -> list[dict]:
    """The synthetic video task's records (videos written under <workdir>/videos); the
    held-out split uses another seed."""
    seed, size = ((opts.seed, opts.data.size) if split == "train"
                  else (opts.seed + 10_000, opts.data.eval_size))
    return video_task.video_dataset(opts.data.task, seed, size, os.path.join(workdir, "videos"),
                                    num_frames=opts.video.frames_in_file, frame=opts.video.frame)


def _expand(paths: str) -> list[str]:
    out = []
    for part in (p.strip() for p in paths.split(",") if p.strip()):
        hits = sorted(glob.glob(part))
        if not hits:
            raise FileNotFoundError(f"video QA data: no file matches {part!r}")
        out.extend(hits)
    return out


def _qa_record(row: dict, d, where: str, base: str) -> dict:
    """One jsonl row -> a record; ValueError (naming the field) when the row is malformed."""
    for field in (d.video_field, d.prompt_field, d.answer_field):
        if field not in row or row[field] in (None, ""):
            raise ValueError(f"no {field!r} field")
    video = str(row[d.video_field])
    video = video if os.path.isabs(video) else os.path.join(d.video_root or base, video)
    question, answer = str(row[d.prompt_field]).strip(), str(row[d.answer_field]).strip()
    choices = row.get(d.choices_field) if d.choices_field else None
    instruction = d.instruction
    if choices is not None:
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"{d.choices_field!r} must be a list of 2 to {len(LETTERS)} options")
        texts = [str(c).strip() for c in choices]
        letters = LETTERS[:len(texts)]
        bare = answer.strip("().: ").upper()
        if len(bare) == 1 and bare in letters:
            answer = bare
        elif answer in texts:
            answer = letters[texts.index(answer)]
        else:
            raise ValueError(f"answer {answer!r} is neither an option letter nor one of the "
                             f"{len(texts)} choices")
        question += "\n" + "\n".join(f"{l}. {t}" for l, t in zip(letters, texts))
        instruction = d.choice_instruction
    text = question.replace("<video>", video_task.VIDEO_PROMPT)
    if video_task.VIDEO_PROMPT not in text:
        text = video_task.VIDEO_PROMPT + text
    if text.count(video_task.VIDEO_PROMPT) != 1:
        raise ValueError("the question holds more than one video placeholder")
    prompt = f"{text} {instruction}".strip()
    messages = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else [])
    messages.append({"role": "user", "content": prompt})
    return {"messages": messages, "prompt": prompt, "answer": answer, "task": "video_qa",
            "video": video, "metadata": {"source": where}}


def load_video_qa(paths: str, d: QAFields) -> tuple[list[dict], list[str]]:
    """Records of comma-separated jsonl files or globs. Returns
    (records, problems): every skipped row as "file:line: reason", each also logged."""
    records, problems = [], []
    for path in _expand(paths):
        base = os.path.dirname(os.path.abspath(path))
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{i}"
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
                    rec = _qa_record(row, d, where, base)
                except ValueError as e:  # json.JSONDecodeError is a ValueError
                    problems.append(f"{where}: malformed row: {e}")
                    continue
                if not os.path.isfile(rec["video"]):
                    problems.append(f"{where}: video file not found: {rec['video']}")
                    continue
                records.append(rec)
    for p in problems:
        log.warning("video QA data: skipping %s", p)
    return records, problems


def records(opts, workdir: str, split: str = "train") -> list[dict]:
    """Training or held-out records of the configured source ([] when there is no held-out
    set); the held-out ones are at most `eval.num_prompts`."""
    if opts.data.source == "synthetic":
        recs = synthetic_records(opts, workdir, split)
    else:
        paths = opts.data.paths if split == "train" else opts.data.eval_paths
        if not paths:
            return []
        recs, _ = load_video_qa(paths, QAFields.of(opts))
        if not recs:
            raise ValueError(f"video QA data {paths!r}: no usable row (see the warnings above)")
    return recs[:opts.eval.num_prompts] if split != "train" else recs


def batch_records(recs: list[dict], step: int, n: int, seed: int, shuffle: bool) -> list[dict]:
    """The n records of a step: a pure function of the step, so that a resumed run continues
    at the same data position. Each epoch visits every record once, shuffled by (seed, epoch)
    when asked."""
    N = len(recs)
    out = []
    for i in range(step * n, step * n + n):
        epoch, j = divmod(i, N)
        order = np.random.default_rng([seed, epoch]).permutation(N) if shuffle else None
        out.append(recs[int(order[j]) if shuffle else j])
    return out


class RecordBatches:
    """The training batches of n records each: batch i is `batch_records(recs, i, ...)`, a
    pure function of i, so the iterator's state is one number and a resumed run continues at
    the same data position."""

    def __init__(self, recs: list[dict], n: int, seed: int, shuffle: bool):
        self.recs, self.n, self.seed, self.shuffle, self.i = recs, n, seed, shuffle, 0

    def __next__(self) -> list[dict]:
        out = batch_records(self.recs, self.i, self.n, self.seed, self.shuffle)
        self.i += 1
        return out

    def get_state(self) -> dict:
        return {"batches": self.i}

    def set_state(self, state: dict) -> None:
        self.i = int(state["batches"])

    def stats(self) -> dict:
        return {"data/batches": self.i, "data/epoch": self.i * self.n // len(self.recs)}


# ----------------------------------------------------------------------------- tokenizer

def _corpus(opts, workdir: str, recs: Optional[list] = None) -> list[str]:
    """Text a tokenizer trained on the fly learns: the task's prompts and answers."""
    if opts.data.source == "synthetic":
        rng = np.random.default_rng(opts.seed)
        out = []
        for _ in range(300):
            d = rng.choice(list(video_task.DIRECTIONS))
            colour = rng.choice(list(video_task.COLOURS))
            out.append(f"Which colour is the shape that moves {d}? Answer with \\boxed{{...}}. "
                       f"The {colour} shape moves {d}. \\boxed{{{colour}}}")
            k = int(rng.integers(0, 10))
            out.append(f"How many squares are in the video? Answer with \\boxed{{...}}. "
                       f"I count {k} squares and circles. \\boxed{{{k}}}")
        return out
    recs = records(opts, workdir) if recs is None else recs
    return [f"{r['prompt']} \\boxed{{{r['answer']}}}" for r in recs]


def build_tokenizer(opts, workdir: str, recs: Optional[list] = None):
    """`tokenizer.path`, else the model directory's tokenizer, else (random policies only) one
    trained on the task's text with Qwen2.5-VL's vision tokens added as special tokens, ids
    `vocab_size + i` in the order of `VISION_TOKENS` (saved under <workdir>/tokenizer);
    `recs`: the training records when already loaded."""
    from lrl.data import tokenizer as tok_lib   # transformers: imported only when needed
    path = opts.tokenizer.path or opts.model.hf_path
    if path:
        tok = tok_lib.load_tokenizer(path)
    else:
        out = os.path.join(workdir, "tokenizer")
        if os.path.isfile(os.path.join(out, "tokenizer.json")):
            tok = tok_lib.load_tokenizer(out)
        else:
            tok = tok_lib.build_tokenizer(_corpus(opts, workdir, recs),
                                         opts.tokenizer.vocab_size)
            tok.add_tokens([AddedToken(t, special=True, normalized=False)
                            for t in VISION_TOKENS], special_tokens=True)
            tok.save_pretrained(out)
    missing = [t for t in VISION_TOKENS if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if missing:
        raise ValueError(f"tokenizer has no ids for the vision tokens {missing}")
    return tok
