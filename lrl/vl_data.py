"""Data for video GRPO (`lrl.vl_grpo`): the tokenizer, the records (synthetic videos or a
video-QA jsonl), MR-SP stage 1 (decode and encode each video once, through the embedding
cache) and the multimodal prompts and update rows.

A record is `lrl.data.video_task`'s: {"messages", "prompt", "answer", "task", "video",
"metadata"}. A video-QA jsonl row holds a local video path, a question and an answer (field
names configurable), optionally a list of choices: the question then lists them as
"A. ...", "B. ..." and the answer becomes the option's letter (given as the letter or as the
option's text). Relative video paths are read against `data.video_root` or else the jsonl's
own directory. Malformed rows are reported by file and line, rows whose video file is missing
by file, line and path; both are skipped. Videos that exist but do not decode are reported by
path at the step that meets them and never tried again.

P prompts · G samples per prompt · B packed rows · T positions · D model width ·
R visual table rows.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Optional

import numpy as np
from tokenizers import AddedToken

from lrl.data import video as video_lib
from lrl.data import video_task
from lrl.models import embed_cache, vl

log = logging.getLogger(__name__)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LETTERS = "ABCDEFGHIJ"


# ----------------------------------------------------------------------------- records

def synthetic_records(config, workdir: str, split: str = "train") -> list[dict]:
    """The synthetic video task's records (videos written under <workdir>/videos); the
    held-out split uses another seed."""
    v = config.video
    seed, size = ((config.seed, v.size) if split == "train"
                  else (config.seed + 10_000, config.eval.num_prompts))
    return video_task.video_dataset(v.task, seed, size, os.path.join(workdir, "videos"),
                                    num_frames=v.frames_in_file, frame=v.frame)


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


def load_video_qa(paths: str, d) -> tuple[list[dict], list[str]]:
    """Records of comma-separated jsonl files or globs; `d` is `config.data`. Returns
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


def records(config, workdir: str, split: str = "train") -> list[dict]:
    """Training or held-out records of the configured source ([] when there is no held-out
    set)."""
    if config.video.source == "synthetic":
        return synthetic_records(config, workdir, split)
    paths = config.data.paths if split == "train" else config.data.eval_paths
    if not paths:
        if split == "train":
            raise ValueError("video.source='jsonl' needs data.paths")
        return []
    recs, _ = load_video_qa(paths, config.data)
    if not recs:
        raise ValueError(f"video QA data {paths!r}: no usable row (see the warnings above)")
    return recs[:config.eval.num_prompts] if split != "train" else recs


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


# ----------------------------------------------------------------------------- tokenizer

def _corpus(config, workdir: str, recs: Optional[list] = None) -> list[str]:
    """Text a tokenizer trained on the fly learns: the task's prompts and answers."""
    if config.video.source == "synthetic":
        rng = np.random.default_rng(config.seed)
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
    recs = records(config, workdir) if recs is None else recs
    return [f"{r['prompt']} \\boxed{{{r['answer']}}}" for r in recs]


def build_tokenizer(config, workdir: str, recs: Optional[list] = None):
    """`tokenizer.path`, else the model directory's tokenizer, else (random policies only) one
    trained on the task's text with Qwen2.5-VL's vision tokens added as special tokens, ids
    `vocab_size + i` in the order of `VISION_TOKENS` (saved under <workdir>/tokenizer);
    `recs`: the training records when already loaded."""
    from lrl.data import tokenizer as tok_lib   # transformers: imported only when needed
    path = config.tokenizer.path or config.model.hf_path
    if path:
        tok = tok_lib.load_tokenizer(path)
    else:
        out = os.path.join(workdir, "tokenizer")
        if os.path.isfile(os.path.join(out, "tokenizer.json")):
            tok = tok_lib.load_tokenizer(out)
        else:
            tok = tok_lib.build_tokenizer(_corpus(config, workdir, recs),
                                         config.tokenizer.vocab_size)
            tok.add_tokens([AddedToken(t, special=True, normalized=False)
                            for t in VISION_TOKENS], special_tokens=True)
            tok.save_pretrained(out)
    missing = [t for t in VISION_TOKENS if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if missing:
        raise ValueError(f"tokenizer has no ids for the vision tokens {missing}")
    return tok


# ----------------------------------------------------------------------------- stage 1

def vision_settings(vl_cfg: vl.VLConfig, v) -> video_lib.VisionSettings:
    unit = (vl_cfg.vision.patch_size * vl_cfg.vision.spatial_merge_size) ** 2
    return video_lib.VisionSettings(
        patch_size=vl_cfg.vision.patch_size, temporal_patch_size=vl_cfg.vision.temporal_patch_size,
        merge_size=vl_cfg.vision.spatial_merge_size, num_frames=v.num_frames,
        video_min_pixels=v.min_tokens_per_frame * unit,
        video_max_pixels=v.max_tokens_per_frame * unit)


@dataclasses.dataclass
class VisionStage:
    """MR-SP stage 1's state across steps: the encoder (frames split over the mesh), the
    embedding cache, the patch grid of every video decoded so far (a cached video is not
    decoded again) and the videos that failed to decode (never tried again)."""
    vl_cfg: vl.VLConfig
    settings: video_lib.VisionSettings
    encoder: embed_cache.Encoder
    cache: embed_cache.EmbeddingCache
    model_id: str
    grids: dict = dataclasses.field(default_factory=dict)   # path -> (grid_thw, s per grid)
    bad: dict = dataclasses.field(default_factory=dict)     # path -> reason

    def known_item(self, path: str) -> Optional[video_lib.VisualItem]:
        """A patch-less item for a video whose embedding is cached (no decoding needed)."""
        if path not in self.grids:
            return None
        grid, seconds = self.grids[path]
        item = video_lib.VisualItem(np.zeros((0, 0), np.float32), grid, "video", seconds, path)
        key = embed_cache.item_key(item, self.settings.fingerprint(), self.model_id)
        return item if self.cache.contains(key) else None


def encode_batch(stage: VisionStage, vision_params, recs: list[dict], pad_to: int = 256):
    """Stage 1 for one batch of records -> (kept records, items, table [R, D], offsets,
    stats). Videos are decoded unless cached, failures are reported by path and dropped, and
    each distinct video missing from the cache is encoded once."""
    stats = {"video/skipped": 0, "video/decoded": 0}
    items, kept, todo = [], [], []
    for r in recs:
        if r["video"] in stage.bad:
            stats["video/skipped"] += 1
            continue
        item = stage.known_item(r["video"])
        kept.append(r)
        items.append(item)
        if item is None:
            todo.append(len(items) - 1)
    paths = list(dict.fromkeys(kept[i]["video"] for i in todo))   # each video decoded once
    decoded, failures = video_lib.load_videos(paths, stage.settings)
    for path, reason in failures:
        stage.bad[path] = reason
    by_path = {it.source: it for it in decoded}
    for i in todo:
        items[i] = by_path.get(kept[i]["video"])
    stats["video/skipped"] += sum(it is None for it in items)
    stats["video/decoded"] = len(decoded)
    kept = [r for r, it in zip(kept, items) if it is not None]
    items = [it for it in items if it is not None]
    for it in decoded:
        stage.grids[it.source] = (tuple(int(g) for g in it.grid_thw), it.seconds_per_grid)
    misses = stage.cache.misses
    text = stage.vl_cfg.text
    per_prompt = embed_cache.prompt_embeddings(stage.vl_cfg.vision, vision_params,
                                               [[it] for it in items], stage.encoder,
                                               stage.cache, stage.settings.fingerprint(),
                                               stage.model_id)
    table, offsets = embed_cache.build_table(per_prompt, text.d_model, text.dtype, pad_to=pad_to)
    stats["vision/encoded_items"] = stage.cache.misses - misses
    stats["vision/table_rows"] = int(table.shape[0])
    return kept, items, table, offsets, stats


# ----------------------------------------------------------------------------- prompts, rows

def visual_prompts(vl_cfg, text_params, tokenizer, recs, items, table, offsets):
    """Per prompt: token ids [T] (the video pad expanded), M-RoPE positions [3, T], input
    embeddings [T, D] (table rows spliced in) and its visual token count."""
    out = []
    for rec, item, off in zip(recs, items, offsets):
        ids = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        n = vl_cfg.tokens_per_item(item.grid_thw)
        ids = video_lib.expand_placeholders(np.asarray(ids, np.int32), vl_cfg.video_token_id,
                                            [n]).astype(np.int32)
        pos, delta = vl.mrope_positions(vl_cfg, ids, video_grids=[item.grid_thw],
                                        video_seconds_per_grid=[item.seconds_per_grid])
        index = vl.visual_index(vl_cfg, ids[None], None, np.array([[-1, off]]),
                                np.array([[0, n]]))
        embeds = vl.embed_tokens(vl_cfg.text, text_params, ids[None], table, index)[0]
        out.append(dict(ids=ids, positions=pos, delta=delta, embeds=embeds, count=n,
                        offset=int(off)))
    return out


def add_visual_rows(vl_cfg, batch, layout, prompts, group_size: int):
    """Packed text rows (`grpo.update_rows`) -> the same rows with `visual_index` [B, T] and
    M-RoPE `positions` [B, 3, T]: sequence i is sample i % G of prompt i // G, and every
    sample of a prompt reads that prompt's table rows."""
    B, T = batch["tokens"].shape
    seg = batch["segment_ids"]
    S = int(seg.max()) + 1
    pos = np.zeros((B, 3, T), np.int32)
    offsets, counts = np.full((B, S), -1, np.int32), np.zeros((B, S), np.int32)
    for i, (r, s) in enumerate(zip(layout["row"], layout["start"])):
        pr = prompts[i // group_size]
        n = int(layout["prompt_len"][i] + layout["completion_len"][i])
        pos[r, :, s:s + n] = vl.extend_positions(pr["positions"], pr["delta"], n)
        offsets[r, seg[r, s]], counts[r, seg[r, s]] = pr["offset"], pr["count"]
    out = dict(batch)
    out["positions"] = pos
    out["visual_index"] = vl.visual_index(vl_cfg, batch["tokens"], seg, offsets, counts)
    return out
