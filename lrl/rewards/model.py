"""A reward model as a reward term: a HF `*ForSequenceClassification` checkpoint scored on the
training mesh, weighted with the rule terms (`reward.spec = "math:0.8,rm:0.2"`).

    rm = load(opts.reward.model, mesh)                        # once, at start-up
    scores = score(rm, messages, responses)                   # float32 [n]
    pool = ModelRewardPool(rule_pool, rm, weight=0.2)         # what the step's `score` calls

Each (prompt, response) is rendered with the reward model's own tokenizer and chat template
(the prompt's messages, then the response as the assistant turn, as verl's reward worker
does), tokenized, and packed best-fit into rows of `max_len` tokens with segment ids. The
rows run through the decoder in calls of one fixed shape [batch_rows, max_len] (the last
call padded with empty rows), so nothing compiles again as lengths change; a sequence's score
is read at its last non-pad token, as transformers' sequence classifier pools. The model
lives on the mesh next to the policy: no server, no copy of weights.

The rule terms still run in the reward pool's worker processes; the model term runs here,
in the loop's process, because it needs the mesh. A prompt's messages reach it through the
item's meta (`messages`, which the text task adds when a reward model is configured) and
are taken out before the rule terms see the meta.

B rows · T positions.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

MODEL_TERM = "rm"           # the spec's name of the reward-model term
MESSAGES_KEY = "messages"   # the meta key that carries a prompt's chat messages


def model_reward(completion: str, answer: str, **meta) -> float:
    """The registry's placeholder for the `rm` term: the model scores on the mesh, in the
    loop's process (`ModelRewardPool`), never in a reward worker."""
    raise RuntimeError("the 'rm' reward term is scored by the reward model on the mesh "
                       "(reward.model.hf_path), not by a reward function; build the pool with "
                       "lrl.build.reward_pool(opts, mesh)")


def split_spec(spec) -> tuple[list, float]:
    """A reward spec -> (the rule terms as (name, weight, kwargs) items, the `rm` weight or
    0.0 when the spec has no `rm` term)."""
    from lrl.rewards.registry import parse_spec
    terms = parse_spec(spec)
    rules = [(t.name, t.weight, dict(t.kwargs)) for t in terms if t.name != MODEL_TERM]
    return rules, float(sum(t.weight for t in terms if t.name == MODEL_TERM))


# ----------------------------------------------------------------------------- start-up

def _score_shape(path: str, key: str) -> list:
    """`score.weight`'s shape from the safetensors headers (no tensor read, no jax)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            name = json.load(f).get("weight_map", {}).get("score.weight")
    else:
        name = "model.safetensors" if os.path.isfile(os.path.join(path, "model.safetensors")) \
            else None
        if name is None:
            raise FileNotFoundError(f"{key}.hf_path={path!r}: no model.safetensors or "
                                    "model.safetensors.index.json there")
    if name is None:
        raise ValueError(f"{key}.hf_path={path!r}: the checkpoint has no 'score.weight'")
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ValueError(f"{key}.hf_path: cannot read the safetensors header of {file}: "
                         f"{e}") from e
    if "score.weight" not in header:
        raise ValueError(f"{key}.hf_path={path!r}: the checkpoint has no 'score.weight'")
    return list(header["score.weight"]["shape"])


def check(opts, key: str = "reward.model") -> dict:
    """Cheap start-up checks of `opts` (options.RewardModelOptions): the checkpoint is a
    one-label *ForSequenceClassification whose safetensors hold `score.weight` [1, D], and the
    tokenizer directory exists. Reads config.json and a safetensors header only (no jax).
    Returns the checkpoint's config.json; raises FileNotFoundError / ValueError naming the
    key and the file."""
    path = opts.hf_path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}.hf_path={path!r}: no such directory")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{key}.hf_path={path!r}: no config.json there")
    with open(config_path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    archs = hf.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{key}.hf_path: {config_path} has architectures={archs}; a reward "
                         "model is a *ForSequenceClassification checkpoint (Llama, Qwen2, "
                         "Qwen3) with a one-label `score` head")
    shape = _score_shape(path, key)
    if shape != [1, int(hf.get("hidden_size", -1))]:
        raise ValueError(f"{key}.hf_path={path!r}: score.weight has shape {shape}; a reward "
                         f"model has one label: [1, hidden_size={hf.get('hidden_size')}]")
    tok = opts.tokenizer_path or path
    if not os.path.isdir(tok):
        raise FileNotFoundError(f"{key}.tokenizer_path={tok!r}: no such directory")
    return hf


@dataclasses.dataclass(frozen=True)
class RewardModel:
    cfg: Any                  # lrl.models.ModelConfig
    params: Any               # the decoder's tree (no lm_head), on the mesh
    head_DL: Any              # [D, 1]
    pad_token_id: Optional[int]
    tokenizer: Any
    mesh: Any
    row_len: int              # T of a row: reward.model.max_len
    rows: int                 # B of one call: reward.model.batch_rows
    fn: Callable              # jitted (params, head, batch) -> scores [B, T]


def load(opts, mesh, attention: str = "dense", dtype=None, key: str = "reward.model"
         ) -> RewardModel:
    """The reward model of `opts` (options.RewardModelOptions) on `mesh` (None: one device),
    its attention `attention` (the policy's: ring / Ulysses over a `seq` axis)."""
    import jax
    import jax.numpy as jnp

    from lrl.data.tokenizer import load_tokenizer
    from lrl.models import score as score_lib
    check(opts, key)
    if jax.process_count() > 1:   # each process would place its rows as the global batch's
        raise ValueError(f"{key}.hf_path is set in a run of {jax.process_count()} processes: "
                         "the reward model scores in one-process runs only for now")
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if opts.batch_rows % shards:
        raise ValueError(f"{key}.batch_rows={opts.batch_rows} is not a multiple of the mesh's "
                         f"data x fsdp = {shards}")
    seq = 1 if mesh is None else mesh.shape["seq"]
    if opts.max_len % (2 * seq):
        raise ValueError(f"{key}.max_len={opts.max_len} is not a multiple of 2 x seq = "
                         f"{2 * seq} (rows split over the mesh's seq axis)")
    tok_path = opts.tokenizer_path or opts.hf_path
    tokenizer = load_tokenizer(tok_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{key}: the tokenizer in {tok_path!r} has no chat_template; the "
                         "reward model scores the conversation in its own template")
    dtype = jnp.dtype(opts.dtype if dtype is None else dtype)
    cfg, params, head_DL, meta = score_lib.load_hf_score(opts.hf_path, dtype, mesh,
                                                         attention=attention, remat="none")

    def scores(p, h, batch):
        return score_lib.token_scores(cfg, p, h, batch, mesh)[..., 0]

    return RewardModel(cfg, params, head_DL, meta["pad_token_id"], tokenizer, mesh,
                       opts.max_len, opts.batch_rows, jax.jit(scores))


# ----------------------------------------------------------------------------- scoring

def render(rm: RewardModel, messages: Sequence[dict], response) -> np.ndarray:
    """The conversation with `response` as the assistant's turn (or, a list of messages, a
    multi-turn trajectory's turns: the model's and its environment's), in the reward model's
    chat template, as token ids (the template writes any BOS itself)."""
    turns = ([{"role": "assistant", "content": response}] if isinstance(response, str)
             else list(response))
    chat = [*messages, *turns]
    text = rm.tokenizer.apply_chat_template(chat, tokenize=False)
    return np.asarray(rm.tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def _last_token(ids: np.ndarray, pad: Optional[int]) -> int:
    """transformers' pooled index: the rightmost token that is not the pad token."""
    if pad is None:
        return len(ids) - 1
    real = np.flatnonzero(ids != pad)
    return int(real[-1]) if real.size else 0


def pack_rows(seqs: Sequence[np.ndarray], row_len: int, max_segments: int):
    """Sequences -> (tokens, segment_ids, positions) [R, row_len] int32 and (row, start) of
    each sequence, best-fit."""
    from lrl.data.packing import best_fit
    row, start = best_fit([len(s) for s in seqs], row_len, max_segments=max_segments)
    R = int(row.max()) + 1 if len(seqs) else 0
    tokens = np.zeros((R, row_len), np.int32)
    seg = np.zeros((R, row_len), np.int32)
    pos = np.zeros((R, row_len), np.int32)
    count = np.zeros(R, np.int32)
    for s, r, a in zip(seqs, row, start):
        count[r] += 1
        tokens[r, a:a + len(s)] = s
        seg[r, a:a + len(s)] = count[r]
        pos[r, a:a + len(s)] = np.arange(len(s))
    return tokens, seg, pos, row, start


def score(rm: RewardModel, messages: Sequence[Sequence[dict]], responses: Sequence
          ) -> tuple[np.ndarray, dict]:
    """Scores float32 [n] of each (messages, response) (a response: text, or a trajectory's
    turns as messages, `render`) and stats: rm_truncated (sequences
    longer than max_len, cut at the right as verl's reward worker cuts them), rm_rows,
    rm_calls, rm_s."""
    from lrl import mesh as mesh_lib
    if len(messages) != len(responses):
        raise ValueError(f"reward model: {len(messages)} prompts for {len(responses)} responses")
    t0 = time.monotonic()
    seqs = [render(rm, m, r) for m, r in zip(messages, responses)]
    truncated = sum(len(s) > rm.row_len for s in seqs)
    seqs = [s[:rm.row_len] for s in seqs]
    ends = [_last_token(s, rm.pad_token_id) for s in seqs]
    tokens, seg, pos, row, start = pack_rows(seqs, rm.row_len, rm.cfg.max_segments - 1)
    out = np.zeros(tokens.shape, np.float32)
    calls = 0
    for lo in range(0, len(tokens), rm.rows):
        hi = min(lo + rm.rows, len(tokens))
        batch = {}
        for name, a in (("tokens", tokens), ("segment_ids", seg), ("positions", pos)):
            b = np.zeros((rm.rows, rm.row_len), np.int32)   # the last call's empty rows
            b[:hi - lo] = a[lo:hi]
            batch[name] = b
        if rm.mesh is not None:
            batch = mesh_lib.put_batch(rm.mesh, batch)
        out[lo:hi] = np.asarray(rm.fn(rm.params, rm.head_DL, batch))[:hi - lo]
        calls += 1
    scores = np.asarray([out[r, a + e] for r, a, e in zip(row, start, ends)], np.float32)
    return scores, {"rm_truncated": float(truncated), "rm_rows": float(len(tokens)),
                    "rm_calls": float(calls), "rm_s": time.monotonic() - t0}


# ----------------------------------------------------------------------------- the pool

class ModelRewardPool:
    """The reward pool of a spec with an `rm` term: the rule terms in a `RewardPool` (None
    when there are none), plus `weight` x the reward model's score, with `RewardPool.score`'s
    interface (items of (completion, answer, meta); meta carries the prompt's messages).
    `workers`: the worker pool a multi-turn rollout's environment steps run in (the rules'
    pool, or one of its own when there are no rule terms); `score_trajectories` scores whole
    conversations."""

    def __init__(self, rules, rm: RewardModel, weight: float, workers=None):
        self.rules, self.rm, self.weight = rules, rm, weight
        self.workers = workers if workers is not None else rules

    @property
    def terms(self) -> tuple:
        """The rule terms (what an environment scores a final answer with)."""
        return () if self.rules is None else tuple(self.rules.terms)

    def score_trajectories(self, messages: Sequence[Sequence[dict]],
                           conversations: Sequence[Sequence[dict]]) -> tuple[np.ndarray, dict]:
        """`weight` x the reward model's score of each prompt's `messages` followed by its
        response (`score`: a text, or a trajectory's turns, `lrl.trajectories.conversation`),
        and the stats `score` gives with term_mean/rm: the model's part of a reward (of a
        trajectory, beside its environment's, which the rule terms scored)."""
        scores, stats = score(self.rm, messages, conversations)
        stats[f"term_mean/{MODEL_TERM}"] = float(scores.mean()) if len(scores) else 0.0
        return np.float32(self.weight) * scores, stats

    def score(self, items) -> tuple[np.ndarray, dict]:
        messages, stripped = [], []
        for i, (completion, answer, *rest) in enumerate(items):
            meta = dict(rest[0] or {}) if rest else {}
            if MESSAGES_KEY not in meta:
                raise ValueError(f"reward model: item {i} has no '{MESSAGES_KEY}' in its meta; "
                                 "the reward model needs the prompt's chat messages (the text "
                                 "task adds them when reward.model.hf_path is set)")
            messages.append(meta.pop(MESSAGES_KEY))
            stripped.append((completion, answer, meta))
        if self.rules is not None:
            rewards, stats = self.rules.score(stripped)
        else:
            rewards, stats = np.zeros(len(items), np.float32), {"n_items": float(len(items))}
        rm, rm_stats = self.score_trajectories(messages, [c for c, _, _ in stripped])
        stats.update(rm_stats)
        return (rewards + rm).astype(np.float32), stats

    def close(self) -> None:
        for pool in {id(p): p for p in (self.rules, self.workers) if p is not None}.values():
            pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
