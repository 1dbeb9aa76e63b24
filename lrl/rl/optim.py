"""The optimizer of the policy update: AdamW with linear warm-up and cosine decay, after
global-norm clipping, built from plain arguments (`for_phase`: from the `optim.*` options).

The learning rate is injected into the optimizer state, so the update step can report the
rate it actually used (`learning_rate(opt_state)`) without knowing the schedule.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

# Parameters that are not weight-decayed: norm scales and biases (as HF Trainer and most
# LLM recipes). Scanned layers give norm scales a leading layer axis, so rank is no guide.
_NO_DECAY = ("norm", "bias")


def lr_schedule(lr: float, warmup_steps: int, total_steps: int,
                end_lr_ratio: float = 0.0) -> Callable[[Any], jax.Array]:
    """step -> learning rate: linear warm-up lr·(step+1)/warmup_steps over the first
    warmup_steps steps (so the first step already moves), then a cosine from lr down to
    lr·end_lr_ratio at step total_steps, constant after."""
    if lr < 0 or warmup_steps < 0 or total_steps < max(warmup_steps, 1):
        raise ValueError(f"lr_schedule: need lr >= 0 and 1 <= total_steps >= warmup_steps >= 0, "
                         f"got lr={lr}, warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not 0.0 <= end_lr_ratio <= 1.0:
        raise ValueError(f"lr_schedule: end_lr_ratio must lie in [0, 1], got {end_lr_ratio}")
    end = lr * end_lr_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = lr * jnp.minimum(1.0, (step + 1.0) / max(warmup_steps, 1))
        progress = jnp.clip((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
        cosine = end + (lr - end) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(step < warmup_steps, warm, cosine)

    return schedule


def default_decay_mask(params) -> Any:
    """True for the parameters that get weight decay: all but norm scales and biases."""
    def decays(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any(tag in name for name in names for tag in _NO_DECAY)
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(*, lr: float, warmup_steps: int, total_steps: int, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                   clip_norm: Optional[float] = 1.0, end_lr_ratio: float = 0.0,
                   decay_mask: Callable[[Any], Any] = default_decay_mask
                   ) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) then AdamW with `lr_schedule`; clip_norm None or 0
    turns clipping off. Moments are kept in the dtype of the parameters (fp32 masters)."""
    if clip_norm is not None and clip_norm < 0:
        raise ValueError(f"make_optimizer: clip_norm must be >= 0 or None, got {clip_norm}")
    if weight_decay < 0:
        raise ValueError(f"make_optimizer: weight_decay must be >= 0, got {weight_decay}")
    # Only the learning rate is injected (the update reports it): optax casts injected floats
    # to the params' dtype, and b2=0.999 in bf16 is 1.0, whose bias correction divides by zero
    # (every update NaN with bf16 masters). Static, the betas and eps stay Python floats.
    adamw = optax.inject_hyperparams(
        optax.adamw, static_args=("mask", "b1", "b2", "eps", "weight_decay"))(
        learning_rate=lr_schedule(lr, warmup_steps, total_steps, end_lr_ratio),
        b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    if not clip_norm:
        return adamw
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def learning_rate(opt_state) -> Optional[jax.Array]:
    """The learning rate the last update used (the injected one), or None if the optimizer
    does not inject it."""
    found = [s.hyperparams["learning_rate"]
             for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
             if hasattr(s, "hyperparams") and "learning_rate" in s.hyperparams]
    if len(found) > 1:
        raise ValueError(f"learning_rate: {len(found)} injected learning rates in the state")
    return found[0] if found else None


def for_phase(o, total_steps: int, lr: Optional[float] = None,
              warmup: Optional[int] = None, offload_cfg=None,
              split_rest: bool = False) -> optax.GradientTransformation:
    """A phase's optimizer from the `optim.*` options `o` (`lrl.options.OptimOptions`), with
    the phase's own `lr` and `warmup` when given. A warm-up longer than the phase (a short
    smoke run of a config tuned for longer ones) is cut to the phase's length, and said so.
    `offload_cfg`: the model config when the optimizer is offloaded (`lrl.rl.offload`):
    masters in its param_dtype, the device copy in its dtype; `split_rest`: the parameters
    are not sharded, so those larger than a layer may be updated a block of rows at a time."""
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
                   compute_dtype=offload_cfg.dtype, master_dtype=offload_cfg.param_dtype,
                   split_rest=split_rest)
