"""Supervised fine-tuning: the masked next-token loss over packed prompt/response rows, as a
pure `sft_step(state, batch) -> (state, metrics)` on the same train state, micro-batching,
accumulation and shardings as the policy update (`lrl.rl.train`).

The loss is the mean negative log-likelihood over all masked (response) tokens of the whole
batch: micro-batches contribute sums and the token count is taken once over the batch, so
accumulation equals the one-big-batch step.

B batch rows · T positions.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from lrl.rl.train import TrainState, accumulate_and_apply, constrain_batch, jit_step
from lrl.rl.update import token_logprobs

SFT_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")


def sft_step(state: TrainState, batch, *, model_cfg, tx, mesh=None, num_micro: int = 1,
             chunk: int = 1024):
    batch = {k: batch[k] for k in SFT_KEYS}
    n_tokens = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)

    def micro_loss(params, mb):
        mb = constrain_batch(mb, mesh)
        logp_BT, _ = token_logprobs(model_cfg, params, mb, mesh, chunk, False)
        mask = mb["loss_mask"].astype(jnp.float32)
        nll = -(logp_BT * mask).sum() / n_tokens
        correct = (logp_BT > jnp.log(0.5)) * mask  # the target had most of the mass
        return nll, {"loss": nll, "token_accuracy_lb": correct.sum() / n_tokens}

    state, metrics = accumulate_and_apply(state, batch, micro_loss, model_cfg=model_cfg, tx=tx,
                                          mesh=mesh, num_micro=num_micro)
    metrics["tokens"] = n_tokens
    return state, metrics


def make_sft_fn(model_cfg, tx, mesh=None, *, num_micro: int = 1, chunk: int = 1024):
    """sft_step jitted once, with the same shardings and donation as the policy update."""
    step = functools.partial(sft_step, model_cfg=model_cfg, tx=tx, mesh=mesh,
                             num_micro=num_micro, chunk=chunk)
    return jit_step(step, model_cfg, tx, mesh)
