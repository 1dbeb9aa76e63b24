"""Supervised fine-tuning: the masked next-token loss over packed prompt/response rows, as a
pure `sft_step(state, batch) -> (state, metrics)` that shares the update step's state,
micro-batching, chunked log-probs and shardings.

The loss is the mean negative log-likelihood over all masked (response) tokens of the whole
batch: micro-batches contribute sums and the token count is taken once over the batch, so
accumulation equals the one-big-batch step.

B batch rows · T positions · M micro-batches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from lrl import models
from lrl.rl import optim
from lrl.rl.update import TrainState, _constrain, _micro_split, _token_logprobs, jit_step

SFT_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")


def sft_step(state: TrainState, batch, *, model_cfg, tx, mesh=None, num_micro: int = 1,
             chunk: int = 1024):
    batch = {k: batch[k] for k in SFT_KEYS}
    rows = batch["tokens"].shape[0]
    if rows % num_micro:
        raise ValueError(f"sft: {rows} rows do not split into num_micro={num_micro}")
    n_tokens = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)

    def micro_loss(params, mb):
        mb = _constrain(mb, mesh)
        logp_BT, _ = _token_logprobs(model_cfg, params, mb, mesh, chunk, False)
        mask = mb["loss_mask"].astype(jnp.float32)
        nll = -(logp_BT * mask).sum() / n_tokens
        correct = (logp_BT > jnp.log(0.5)) * mask  # the target had most of the mass
        return nll, {"loss": nll, "token_accuracy_lb": correct.sum() / n_tokens}

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(carry, mb):
        g_acc, m_acc = carry
        (_, m), g = grad_fn(state.params, mb)
        return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g),
                jax.tree.map(jnp.add, m_acc, m)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    if mesh is not None:
        zeros = jax.lax.with_sharding_constraint(
            zeros, models.param_shardings(model_cfg, mesh, state.params))
    m0 = {"loss": jnp.zeros(()), "token_accuracy_lb": jnp.zeros(())}
    (grads, metrics), _ = jax.lax.scan(body, (zeros, m0), _micro_split(batch, num_micro))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics.update(grad_norm=optax.global_norm(grads), update_norm=optax.global_norm(updates),
                   tokens=n_tokens)
    lr = optim.learning_rate(opt_state)
    if lr is not None:
        metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return TrainState(state.step + 1, params, opt_state), metrics


def make_sft_fn(model_cfg, tx, mesh=None, *, num_micro: int = 1, chunk: int = 1024):
    """sft_step jitted once, with the same shardings and donation as the policy update."""
    step = functools.partial(sft_step, model_cfg=model_cfg, tx=tx, mesh=mesh,
                             num_micro=num_micro, chunk=chunk)
    return jit_step(step, model_cfg, tx, mesh)
