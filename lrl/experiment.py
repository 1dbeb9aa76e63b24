"""Builds an experiment's pieces from its config: mesh, tokenizer, model, data, rewards,
optimizer and loss options. Each builder is a plain function of the (locked) config, so the
loop reads as the data flow of a step and nothing here holds state of its own.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp

from lrl import mesh as mesh_lib
from lrl import models

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def config_from_file(path: str, arg: str | None = None):
    """`get_config(arg)` of a config file: how one config builds on another (configs/ is a
    folder of files, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "lrl_config_" + os.path.basename(path)[:-3], path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"no config file {path!r}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg) if arg else mod.get_config()


def check_config(config) -> None:
    """Fails fast, before any compile or training, on values that would only break later."""
    choices = {"job": (config.job, ("grpo", "sft", "grpo_video")),
               "data.source": (config.data.source, ("synthetic", "jsonl", "parquet")),
               "rl.overlong": (config.rl.overlong, ("none", "mask", "penalty")),
               "model.dtype": (config.model.dtype, tuple(_DTYPES)),
               "model.param_dtype": (config.model.param_dtype, tuple(_DTYPES))}
    for key, (value, valid) in choices.items():
        if value not in valid:
            raise ValueError(f"{key}={value!r}; choose one of {valid}")
    from lrl.models.config import check_param_shard_axes
    check_param_shard_axes(param_shard_axes(config.model.param_shard_axes),
                           "model.param_shard_axes", config.model.param_shard_axes)
    from lrl.rl.advantages import ESTIMATORS
    if config.rl.estimator not in ESTIMATORS:
        raise ValueError(f"rl.estimator={config.rl.estimator!r}; choose one of {ESTIMATORS}")
    if config.data.source != "synthetic" and not config.data.paths:
        raise ValueError(f"data.source={config.data.source!r} needs data.paths")
    if config.sft.steps and config.data.source != "synthetic" and not config.sft.paths:
        raise ValueError("sft.steps > 0 needs prompt/response records in sft.paths unless "
                         "data.source='synthetic' (or set sft.steps=0)")
    if config.rl.logprob_chunk < 1:
        raise ValueError(f"rl.logprob_chunk={config.rl.logprob_chunk}: the positions per step "
                         "of the chunked log-prob scan must be at least 1")
    if config.job == "grpo" and config.rl.group_size < 2:
        raise ValueError(f"rl.group_size={config.rl.group_size}: GRPO needs at least 2 "
                         "samples per prompt")


def dtype(name: str):
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def build_mesh(config):
    mesh_lib.maybe_initialize_distributed(config.distributed)
    mesh = mesh_lib.make_mesh(dict(config.mesh))
    logging.info("mesh: %s", mesh_lib.describe(mesh))
    return mesh


def data_shards(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def build_tokenizer(config, workdir: str):
    """A local HF tokenizer, or one trained on the synthetic task (saved in the workdir so a
    resumed run and the export use the same one)."""
    from lrl.data import tokenizer as tok_lib
    if config.tokenizer.path:
        return tok_lib.load_tokenizer(config.tokenizer.path)
    if config.data.source != "synthetic":
        raise ValueError("tokenizer.path is empty: a trained-on-the-fly tokenizer exists only "
                         "for data.source='synthetic'; point tokenizer.path at the model's "
                         "tokenizer directory")
    out = os.path.join(workdir, "tokenizer")
    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return tok_lib.load_tokenizer(out)
    from lrl.data.synthetic import synthetic_corpus
    corpus = synthetic_corpus(2000, seed=config.seed, tasks=(config.data.task,),
                              task_kwargs={config.data.task: task_kwargs(config)})
    # Only process 0 writes; the others train the same deterministic tokenizer in memory.
    return tok_lib.build_tokenizer(corpus, config.tokenizer.vocab_size,
                                   out_dir=out if jax.process_index() == 0 else None)


def param_shard_axes(spec: str) -> tuple[str, ...]:
    """model.param_shard_axes, "fsdp" or "fsdp,seq" -> ("fsdp",) or ("fsdp", "seq")."""
    return tuple(a.strip() for a in spec.split(",") if a.strip())


def model_config(config, tokenizer) -> models.ModelConfig:
    m = config.model
    run = dict(dtype=dtype(m.dtype), param_dtype=dtype(m.param_dtype), attention=m.attention,
               attention_impl=m.attention_impl or None, remat=m.remat,
               param_shard_axes=param_shard_axes(m.param_shard_axes))
    if m.hf_path:
        return models.from_hf_dir(m.hf_path, **run)
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return models.ModelConfig(
        model_type=m.model_type, vocab_size=len(tokenizer), d_model=m.d_model,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings,
        qkv_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3",
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=eos, **run)


def initial_params(config, cfg: models.ModelConfig, mesh):
    if config.model.hf_path:
        # load_hf's `dtype` is the compute dtype here; the master weights' is an override.
        _, params = models.load_hf(config.model.hf_path, mesh=mesh,
                                   **{f.name: getattr(cfg, f.name) for f in
                                      dataclasses.fields(cfg) if f.name in
                                      ("dtype", "param_dtype", "attention", "attention_impl",
                                       "remat", "param_shard_axes")})
        return params
    return models.init_params(cfg, jax.random.key(config.seed), mesh)


def _file_fields(config, paths: str, **extra):
    d = config.data
    return dict(paths=[p for p in paths.split(",") if p], prompt_field=d.prompt_field,
                answer_field=d.answer_field or None, messages_field=d.messages_field or None,
                system_prompt=d.system_prompt or None, **extra)


def task_kwargs(config) -> dict:
    """The synthetic task's arguments: `data.task_kwargs` holds one entry per task."""
    if config.data.task not in config.data.task_kwargs:
        raise ValueError(f"data.task={config.data.task!r} has no entry in data.task_kwargs "
                         f"(entries: {sorted(config.data.task_kwargs)})")
    return dict(config.data.task_kwargs[config.data.task])


def prompt_source(config, split: str = "train"):
    from lrl.data import sources
    d = config.data
    if d.source == "synthetic":
        seed = config.seed if split == "train" else config.seed + 10_000
        size = d.size if split == "train" else d.eval_size
        return sources.SyntheticSource(d.task, size, seed=seed, **task_kwargs(config))
    if d.source not in ("jsonl", "parquet"):
        raise ValueError(f"data.source={d.source!r}; choose synthetic, jsonl or parquet")
    paths = d.paths if split == "train" else d.eval_paths
    if not paths:
        if split == "train":
            raise ValueError(f"data.source={d.source!r} needs data.paths")
        return None
    return sources.file_source(**_file_fields(config, paths))


def sft_source(config):
    from lrl.data import sources
    if config.sft.paths:
        return sources.file_source(**_file_fields(config, config.sft.paths,
                                                  response_field=config.sft.response_field))
    if config.data.source != "synthetic":
        raise ValueError("sft.paths is empty: an SFT phase needs prompt/response records "
                         "(sft.paths) unless data.source='synthetic'")
    return sources.SyntheticSource(config.data.task, config.data.size, seed=config.seed + 1,
                                   sft=True, answer_noise=config.sft.answer_noise,
                                   **task_kwargs(config))


def prompt_iterator(config, tokenizer, mesh, split: str = "train"):
    from lrl.data.prompts import PromptIterator
    source = prompt_source(config, split)
    if source is None:
        return None
    n = config.rl.prompts_per_step if split == "train" else config.eval.num_prompts
    shards = data_shards(mesh) // jax.process_count()
    if n % (jax.process_count() * max(shards, 1)):
        raise ValueError(f"{n} prompts per step do not divide over {jax.process_count()} "
                         f"processes x {shards} data shards")
    return PromptIterator(source, tokenizer, batch_size=n // jax.process_count(),
                          max_prompt_len=config.data.max_prompt_len,
                          seed=config.seed + (0 if split == "train" else 1),
                          num_epochs=None if split == "train" else 1,
                          process_index=jax.process_index(),
                          process_count=jax.process_count(), num_data_shards=max(shards, 1))


def sft_iterator(config, tokenizer, mesh):
    from lrl.data.prompts import SFTIterator
    rows = config.sft.rows // jax.process_count()
    return SFTIterator(sft_source(config), tokenizer, rows=rows, row_len=config.sft.row_len,
                       seed=config.seed + 2, process_index=jax.process_index(),
                       process_count=jax.process_count(), truncate=True)


def reward_pool(config):
    from lrl.rewards import RewardPool
    spec = config.reward.spec
    return RewardPool(spec, num_workers=config.reward.num_workers,
                      timeout_s=config.reward.timeout_s)


def loss_config(config):
    from lrl.rl.losses import LossConfig
    L = config.rl.loss
    return LossConfig(clip_low=L.clip_low, clip_high=L.clip_high,
                      dual_clip=L.dual_clip or None, ratio_level=L.ratio_level,
                      aggregation=L.aggregation, max_len=config.rl.max_new_tokens,
                      kl_coef=L.kl_coef, kl_estimator=L.kl_estimator,
                      entropy_coef=L.entropy_coef, tis_cap=L.tis_cap or None)


def optimizer(o, total_steps: int, lr: float | None = None, warmup: int | None = None):
    """The phase's optimizer. A warm-up longer than the phase (a short smoke run of a config
    tuned for longer ones) is cut to the phase's length, and said so."""
    from lrl.rl.optim import make_optimizer
    total_steps = max(total_steps, 1)
    warmup = o.warmup_steps if warmup is None else warmup
    if warmup > total_steps:
        logging.warning("warm-up of %d steps is longer than the %d-step phase: cut to %d",
                        warmup, total_steps, total_steps)
        warmup = total_steps
    return make_optimizer(lr=o.lr if lr is None else lr, warmup_steps=warmup,
                          total_steps=total_steps, b1=o.b1, b2=o.b2,
                          weight_decay=o.weight_decay, clip_norm=o.clip_norm)
