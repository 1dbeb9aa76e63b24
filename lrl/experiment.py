"""Builds an experiment's shared pieces from its options: the typed options themselves (once,
from the locked config, `options`), the mesh, rewards, optimizer and loss options. What
differs between text and video (tokenizer, model, prompts) is the task's (`lrl.tasks`).
Each builder is a plain function, so the loop reads as the data flow of a step and nothing
here holds state of its own.
"""
from __future__ import annotations

import logging

import jax.numpy as jnp

from lrl import mesh as mesh_lib
from lrl import options as options_lib

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def options(config, check_files: bool = True) -> options_lib.Options:
    """The typed, frozen options of a config, every field and file checked (see
    `lrl.options`); what the loop passes down instead of the ConfigDict."""
    return options_lib.from_config(config, check_files=check_files)


def dtype(name: str):
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def build_mesh(opts: options_lib.Options):
    mesh_lib.maybe_initialize_distributed(opts.distributed)
    mesh = mesh_lib.make_mesh(opts.mesh.sizes())
    logging.info("mesh: %s", mesh_lib.describe(mesh))
    return mesh


def build_meshes(opts: options_lib.Options):
    """-> (the training mesh, the rollout mesh or None). With `pipeline.rollout_devices` = n
    the last n devices form the rollout mesh (`tensor` = `pipeline.rollout_tensor`, or n) and
    the `mesh.*` sizes shape the others; errors name the options that do not fit."""
    n = opts.pipeline.rollout_devices
    if not n:
        return build_mesh(opts), None
    import jax
    mesh_lib.maybe_initialize_distributed(opts.distributed)
    devices = jax.devices()
    if jax.process_count() > 1:
        raise ValueError(f"pipeline.rollout_devices={n} runs in one process only, not "
                         f"{jax.process_count()}")
    if n >= len(devices):
        raise ValueError(f"pipeline.rollout_devices={n} of the {len(devices)} devices leaves "
                         "none to train: the pipeline needs at least 2 devices and one "
                         "training; leave it 0 to run rollout and update in turn")
    train, rollout = mesh_lib.split_devices(devices, n)
    try:
        mesh = mesh_lib.make_mesh(opts.mesh.sizes(), train)
    except ValueError as e:
        raise ValueError(f"{e} (pipeline.rollout_devices={n} leaves {len(train)} devices to "
                         "the mesh.* sizes)") from e
    tensor = opts.pipeline.rollout_tensor or n
    if len(train) % tensor:
        raise ValueError(f"pipeline.rollout_tensor={tensor} does not divide the {len(train)} "
                         "training devices (pipeline.rollout_devices="
                         f"{n}): the weights are gathered on them into the rollout's "
                         "tensor slices before the copy")
    rollout_mesh = mesh_lib.make_mesh({"fsdp": -1, "tensor": tensor}, rollout)
    logging.info("mesh: train %s, rollout %s", mesh_lib.describe(mesh),
                 mesh_lib.describe(rollout_mesh))
    return mesh, rollout_mesh


def data_shards(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def reward_pool(opts: options_lib.Options, mesh=None):
    """The rule terms' worker pool; with a reward model (`reward.model.hf_path`), that pool
    and the model on `mesh` together (`lrl.rewards.model.ModelRewardPool`)."""
    from lrl.rewards import RewardPool
    r = opts.reward
    if not r.model.hf_path:
        return RewardPool(r.spec, num_workers=r.num_workers, timeout_s=r.timeout_s,
                          fail_frac=r.fail_frac, fail_patience=r.fail_patience)
    from lrl.rewards import model as rm_lib
    rules, weight = rm_lib.split_spec(r.spec)
    pool = RewardPool(rules, num_workers=r.num_workers, timeout_s=r.timeout_s,
                      fail_frac=r.fail_frac, fail_patience=r.fail_patience) if rules else None
    rm = rm_lib.load(r.model, mesh, attention=opts.model.attention)
    return rm_lib.ModelRewardPool(pool, rm, weight)


def loss_config(opts: options_lib.Options):
    from lrl.rl.losses import LossConfig
    L = opts.rl.loss
    return LossConfig(clip_low=L.clip_low, clip_high=L.clip_high,
                      dual_clip=L.dual_clip or None, ratio_level=L.ratio_level,
                      aggregation=L.aggregation, max_len=opts.rl.max_new_tokens,
                      kl_coef=L.kl_coef, kl_estimator=L.kl_estimator,
                      entropy_coef=L.entropy_coef, tis_cap=L.tis_cap or None,
                      tis_level=L.tis_level,
                      mask_level=None if L.mask_level == "none" else L.mask_level,
                      mask_low=L.mask_low, mask_high=L.mask_high,
                      staleness_decay=L.staleness_decay,
                      max_staleness=None if L.max_staleness < 0 else L.max_staleness,
                      policy_loss=L.policy_loss)


def offload(o: options_lib.OptimOptions, model_cfg, mesh):
    """-> (the model config when `optim.offload` puts masters and moments in host memory,
    else None; why), by `lrl.rl.offload.decide_for`."""
    from lrl.rl import offload as offload_lib
    on, why = offload_lib.decide_for(o.offload, model_cfg, mesh)
    logging.info("optimizer offload %s (%s)", "on" if on else "off", why)
    return (model_cfg if on else None), why


def optimizer(o: options_lib.OptimOptions, total_steps: int, lr: float | None = None,
              warmup: int | None = None, offload_cfg=None):
    """The phase's optimizer. A warm-up longer than the phase (a short smoke run of a config
    tuned for longer ones) is cut to the phase's length, and said so. `offload_cfg`: the
    model config when the optimizer is offloaded (`offload`): masters in its param_dtype,
    the device copy in its dtype."""
    from lrl.rl.optim import make_optimizer
    total_steps = max(total_steps, 1)
    warmup = o.warmup_steps if warmup is None else warmup
    if warmup > total_steps:
        logging.warning("warm-up of %d steps is longer than the %d-step phase: cut to %d",
                        warmup, total_steps, total_steps)
        warmup = total_steps
    kw = dict(lr=o.lr if lr is None else lr, warmup_steps=warmup, total_steps=total_steps,
              b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    if offload_cfg is None:
        return make_optimizer(**kw, clip_norm=o.clip_norm)
    from lrl.rl.offload import Offload
    # The clip runs on the device over all gradients; the element-wise AdamW layer by layer.
    return Offload(make_optimizer(**kw, clip_norm=None), o.clip_norm or None,
                   compute_dtype=offload_cfg.dtype, master_dtype=offload_cfg.param_dtype)
