"""The text task: prompts from a grain pipeline (synthetic tasks, jsonl or parquet) through the
tokenizer's chat template; update rows carry nothing beyond the text arrays and the forward
is the text decoder's. Also the SFT warm start's batches.

P prompts.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from lrl import distributed, models
from lrl.mesh import data_shards
from lrl.models.config import dtype
from lrl.tasks import Prompt


class TextTask:
    extra_keys = ()
    multimodal = False   # prompts are token ids (the engine's prefill embeds them)
    hidden = staticmethod(models.batch_hidden_states)

    def __init__(self, opts, workdir: str, mesh):
        self.opts, self.workdir, self.mesh = opts, workdir, mesh
        self.tokenizer = build_tokenizer(opts, workdir)
        self.model_cfg = model_config(opts, self.tokenizer)

    # ---- model and data
    def initial_params(self):
        return initial_params(self.opts, self.model_cfg, self.mesh)

    def prompts(self, split: str = "train"):
        """The training prompts: batches of every process's prompts (`GlobalBatches`)."""
        return GlobalBatches(prompt_iterator(self.opts, self.tokenizer, self.mesh, split))

    def eval_batches(self) -> list:
        """Every held-out batch, the same on every process (see `GlobalBatches`): each
        process's batches, all of them run by every process."""
        it = prompt_iterator(self.opts, self.tokenizer, self.mesh, "eval")
        if it is None:
            return []
        local = list(it)
        parts = distributed.allgather_objects(local)
        return [b for p in parts for b in p]

    def sft_batches(self):
        return sft_iterator(self.opts, self.tokenizer)

    # ---- a step
    def prepare(self, params, raw: dict):
        """A raw batch of the prompt iterator -> ([Prompt], metrics)."""
        del params
        texts = self.tokenizer.batch_decode([list(map(int, ids)) for ids in raw["prompt_ids"]])
        prompts = [Prompt(np.asarray(ids, np.int32), str(ans), dict(meta or {}, task=task), text)
                   for ids, ans, meta, task, text in zip(raw["prompt_ids"], raw["answer"],
                                                         raw["metadata"], raw["task"], texts)]
        if self.opts.reward.model.hf_path:  # the reward model renders them in its template
            for p, messages in zip(prompts, raw["messages"]):
                p.meta["messages"] = list(messages)
        return prompts, {}

    def update_inputs(self, rows: dict, layout, sample_prompts):
        """Text rows carry nothing more, and the text decoder reads nothing but the rows."""
        return rows, None

    def row_specs(self, rows: int, T: int) -> dict:
        """The update rows' arrays beyond (or instead of) the text ones: none."""
        return {}

    def extra_spec(self):
        return None

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass


class GlobalBatches:
    """A prompt iterator whose batches are every process's batch joined, in process order, on
    every process.

    A multi-controller run must launch the same programs on the same inputs everywhere: the
    rollout's prefill buckets, decode calls and dynamic-sampling decisions all depend on the
    prompts, so every process decodes the global batch (same seed, same samples) and later
    keeps its own share for the update (`lrl.grpo.process_share`)."""

    def __init__(self, local):
        self.local = local

    def __next__(self) -> dict:
        batch = next(self.local)
        if jax.process_count() == 1:
            return batch
        parts = distributed.allgather_objects(
            {k: batch[k] for k in ("prompt_ids", "answer", "task", "metadata")})
        return {k: [x for p in parts for x in p[k]] for k in parts[0]}

    def get_state(self):
        return self.local.get_state()

    def set_state(self, state) -> None:
        self.local.set_state(state)

    def stats(self) -> dict:
        return self.local.stats()


# ----------------------------------------------------------------------------- builders

def build_tokenizer(opts, workdir: str):
    """A local HF tokenizer, or one trained on the synthetic task (saved in the workdir so a
    resumed run and the export use the same one)."""
    from lrl.data import tokenizer as tok_lib
    if opts.tokenizer.path:
        return tok_lib.load_tokenizer(opts.tokenizer.path)
    if opts.data.source != "synthetic":
        raise ValueError("tokenizer.path is empty: a trained-on-the-fly tokenizer exists only "
                         "for data.source='synthetic'; point tokenizer.path at the model's "
                         "tokenizer directory")
    out = os.path.join(workdir, "tokenizer")
    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return tok_lib.load_tokenizer(out)
    from lrl.data.synthetic import TOOL_TASKS, synthetic_corpus
    corpus = synthetic_corpus(2000, seed=opts.seed, tasks=(opts.data.task,),
                              task_kwargs={opts.data.task: task_kwargs(opts)})
    # Only process 0 writes; the others train the same deterministic tokenizer in memory.
    return tok_lib.build_tokenizer(corpus, opts.tokenizer.vocab_size,
                                   out_dir=out if jax.process_index() == 0 else None,
                                   tools=opts.data.task in TOOL_TASKS)


def model_config(opts, tokenizer) -> models.ModelConfig:
    m = opts.model
    run = dict(dtype=dtype(m.dtype), param_dtype=dtype(m.param_dtype), attention=m.attention,
               attention_impl=m.attention_impl or None, remat=m.remat,
               param_shard_axes=m.shard_axes)
    if m.hf_path:
        return models.from_hf_dir(m.hf_path, **run)
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return models.ModelConfig(
        model_type=m.model_type, vocab_size=vocab_size(m, tokenizer), d_model=m.d_model,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings,
        qkv_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3",
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=eos, **run)


def vocab_size(m, tokenizer) -> int:
    """model.vocab_size, or the tokenizer's; a vocabulary smaller than the tokenizer's is an
    error (its ids would index past the embedding)."""
    if m.vocab_size and m.vocab_size < len(tokenizer):
        raise ValueError(f"model.vocab_size={m.vocab_size} < the tokenizer's {len(tokenizer)} "
                         "tokens")
    return m.vocab_size or len(tokenizer)


def initial_params(opts, cfg: models.ModelConfig, mesh):
    if opts.model.hf_path:
        # load_hf's `dtype` is the compute dtype here; the master weights' is an override.
        _, params = models.load_hf(opts.model.hf_path, mesh=mesh,
                                   **{f.name: getattr(cfg, f.name) for f in
                                      dataclasses.fields(cfg) if f.name in
                                      ("dtype", "param_dtype", "attention", "attention_impl",
                                       "remat", "param_shard_axes")})
        return params
    return models.init_params(cfg, jax.random.key(opts.seed), mesh)


def task_kwargs(opts) -> dict:
    """The synthetic task's arguments: `data.task_kwargs` holds one entry per task."""
    return dict(opts.data.task_kwargs[opts.data.task])


def _file_fields(opts, paths: str, **extra):
    d = opts.data
    return dict(paths=[p for p in paths.split(",") if p], prompt_field=d.prompt_field,
                answer_field=d.answer_field or None, messages_field=d.messages_field or None,
                system_prompt=d.system_prompt or None, **extra)


def prompt_source(opts, split: str = "train"):
    from lrl.data import sources
    d = opts.data
    if d.source == "synthetic":
        seed = opts.seed if split == "train" else opts.seed + 10_000
        size = d.size if split == "train" else d.eval_size
        return sources.SyntheticSource(d.task, size, seed=seed, **task_kwargs(opts))
    paths = d.paths if split == "train" else d.eval_paths
    if not paths:
        return None
    return sources.file_source(**_file_fields(opts, paths))


def sft_source(opts):
    from lrl.data import sources
    if opts.sft.paths:
        return sources.file_source(**_file_fields(opts, opts.sft.paths,
                                                  response_field=opts.sft.response_field))
    return sources.SyntheticSource(opts.data.task, opts.data.size, seed=opts.seed + 1,
                                   sft=True, answer_noise=opts.sft.answer_noise,
                                   **task_kwargs(opts))


def prompt_iterator(opts, tokenizer, mesh, split: str = "train"):
    from lrl.data.prompts import PromptIterator
    source = prompt_source(opts, split)
    if source is None:
        return None
    n = opts.rl.prompts_per_step if split == "train" else opts.eval.num_prompts
    shards = data_shards(mesh) // jax.process_count()
    if n % (jax.process_count() * max(shards, 1)):
        key = "rl.prompts_per_step" if split == "train" else "eval.num_prompts"
        raise ValueError(f"{key}={n} does not divide over {jax.process_count()} processes x "
                         f"{shards} data shards")
    return PromptIterator(source, tokenizer, batch_size=n // jax.process_count(),
                          max_prompt_len=opts.data.max_prompt_len,
                          seed=opts.seed + (0 if split == "train" else 1),
                          num_epochs=None if split == "train" else 1,
                          process_index=jax.process_index(),
                          process_count=jax.process_count(), num_data_shards=max(shards, 1))


def sft_iterator(opts, tokenizer):
    from lrl.data.prompts import SFTIterator
    rows = opts.sft.rows // jax.process_count()
    return SFTIterator(sft_source(opts), tokenizer, rows=rows, row_len=opts.sft.row_len,
                       seed=opts.seed + 2, process_index=jax.process_index(),
                       process_count=jax.process_count(), truncate=True)
