"""The policy update: a pure `update_step(state, batch) -> (state, metrics)` over packed rows,
jit-compiled once over the mesh by `make_update_fn`, and a forward-only `logprobs` pass for
old / reference log-probs.

A batch is a dict of [B, T] arrays (see `lrl.data.packing`):
  tokens, positions, segment_ids (0 = padding), targets (next token within the segment),
  loss_mask (1 where the target is a completion token), advantages (per token),
  old_logp (optional: absent means on-policy, ratio exactly 1), ref_logp (optional, for KL),
  rollout_logp (optional, for truncated importance sampling).
The B rows are split into `num_micro` micro-batches whose gradients a `lax.scan` adds up; the
loss denominators are computed once over all B rows (all data shards: under jit the batch is
one global array), so the step equals the one-big-batch step.

Vision-language batches (optional) add `visual_index` [B, T] (row of the visual table each
token reads, -1 for text) and carry `positions` as [B, 3, T] M-RoPE positions (rows first, so
they split into micro-batches like every other key). The visual table [R, D] is a separate
argument, shared by all micro-batches: the frozen vision tower's cached output
(`lrl.models.embed_cache`), which gets no gradient.

Dimension letters: B batch rows · T positions · D model width · V vocabulary ·
M micro-batches.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from lrl import mesh as mesh_lib
from lrl import models
from lrl.models.scan_buffers import UninitialisedScanJit
from lrl.rl import losses, optim
from lrl.rl.fused_head import fused_token_loss
from lrl.rl.logprobs import token_logprobs_and_entropy

REQUIRED_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages")
OPTIONAL_KEYS = ("old_logp", "ref_logp", "rollout_logp", "visual_index")


class TrainState(NamedTuple):
    step: jax.Array   # int32 scalar: updates applied so far
    params: Any       # master weights, in cfg.param_dtype (fp32 for training)
    opt_state: Any


def _check_batch(batch, num_micro: int, required=REQUIRED_KEYS, optional=OPTIONAL_KEYS):
    missing = [k for k in required if k not in batch]
    unknown = [k for k in batch if optional is not None and k not in required + optional]
    if missing or unknown:
        raise ValueError(f"update: batch is missing {missing} / has unknown keys {unknown}; "
                         f"keys are {required} and optionally {optional}")
    shape = batch["tokens"].shape
    mrope = "visual_index" in batch   # positions [B, 3, T]
    want = lambda k: (shape[0], 3, shape[1]) if mrope and k == "positions" else shape  # noqa: E731
    bad = {k: v.shape for k, v in batch.items() if v.shape != want(k) or len(shape) != 2}
    if bad:
        raise ValueError(f"update: every batch array must be [B, T] = {shape}, got {bad}")
    if num_micro < 1 or shape[0] % num_micro:
        raise ValueError(f"update: {shape[0]} rows do not split into num_micro={num_micro} "
                         "micro-batches")


def _micro_split(batch, num_micro: int):
    """[B, T] -> [M, B/M, T], micro-batch m = rows m, m+M, m+2M, ...: rows are sharded in
    contiguous blocks, so every micro-batch keeps rows on every data shard."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num_micro, *x.shape[1:]), 0, 1),
                        batch)


def _micro_merge(x_MBT):
    return jnp.swapaxes(x_MBT, 0, 1).reshape(-1, *x_MBT.shape[2:])


def _constrain(batch: dict, mesh):
    """Rows over (data, fsdp), positions over seq; M-RoPE positions [B, 3, T] keep their 3
    whole and split T like the tokens."""
    if mesh is None:
        return batch

    def one(key, x):
        if key == "positions" and x.ndim == 3:
            rows, seq = mesh_lib.batch_spec(mesh, 2)
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(rows, None, seq)))
        return jax.lax.with_sharding_constraint(x, mesh_lib.batch_sharding(mesh, x.ndim))
    return {k: one(k, x) for k, x in batch.items()}


def _hidden_and_unembedding(model_cfg, params, mb, mesh, packed=True, visual_table_RD=None):
    """Final hidden states x_BTD and the unembedding w_DV in the compute dtype."""
    # packed=False: every row is one sequence, so attention needs no segment mask (cuDNN's
    # plain causal kernel instead of its packed layout); the loss still reads segment_ids.
    if "visual_index" in mb:
        if visual_table_RD is None:
            raise ValueError("update: the batch has visual_index but no visual table was given")
        from lrl.models import vl
        x_BTD = vl.vl_hidden_states(model_cfg, params, mb["tokens"],
                                    jnp.swapaxes(mb["positions"], 0, 1), mb["segment_ids"],
                                    jax.lax.stop_gradient(visual_table_RD), mb["visual_index"],
                                    mesh)
    else:
        x_BTD = models.hidden_states(model_cfg, params, mb["tokens"], mb["positions"],
                                     mb["segment_ids"] if packed else None, mesh)
    w_DV = models.unembedding(model_cfg, params).astype(x_BTD.dtype)
    if mesh is not None:
        # Gather D (fsdp) once, before the chunk loop, instead of once per chunk inside it;
        # V stays split over tensor where it divides.
        v_axis = "tensor" if w_DV.shape[1] % mesh.shape["tensor"] == 0 else None
        w_DV = jax.lax.with_sharding_constraint(w_DV, NamedSharding(mesh, P(None, v_axis)))
    return x_BTD, w_DV


def _token_logprobs(model_cfg, params, mb, mesh, chunk, compute_entropy, packed=True,
                    visual_table_RD=None):
    x_BTD, w_DV = _hidden_and_unembedding(model_cfg, params, mb, mesh, packed, visual_table_RD)
    return token_logprobs_and_entropy(x_BTD, w_DV,
                                      mb["targets"].astype(jnp.int32), chunk=chunk,
                                      compute_entropy=compute_entropy)


def _metric_identity(shapes):
    """Start values for combining micro-batch metrics: +inf for mins, -inf for maxes, else 0."""
    return {k: jnp.full(s.shape, jnp.inf if k.endswith("_min") else
                        -jnp.inf if k.endswith("_max") else 0.0, s.dtype)
            for k, s in shapes.items()}


def update_step(state: TrainState, batch, visual_table_RD=None, *, model_cfg,
                loss_cfg: losses.LossConfig, tx: optax.GradientTransformation, mesh=None,
                num_micro: int = 1, chunk: int = 1024, compute_entropy: bool = True,
                packed: bool = True, fused_head: bool = True):
    """One optimizer step on a minibatch of packed rows -> (new state, metrics).

    Gradients are taken with respect to the master params (the model casts them to
    cfg.dtype for compute) and accumulated in fp32 over `num_micro` micro-batches.
    `compute_entropy` adds the (cheap) entropy metric; it is needed when
    loss_cfg.entropy_coef != 0. `fused_head` forms the loss's gradient in the lm head's
    forward pass (`lrl.rl.fused_head`: no logits recomputed) when the ratios are per token;
    GSPO's sequence ratios always take the unfused path.
    """
    _check_batch(batch, num_micro)
    if loss_cfg.entropy_coef != 0.0 and not compute_entropy:
        raise ValueError("update: entropy_coef != 0 needs compute_entropy=True")
    denoms = losses.loss_denominators(batch["loss_mask"], batch["segment_ids"], loss_cfg.max_len)

    def terms(logp_BT, ent_BT, mb):
        if loss_cfg.entropy_coef == 0.0:
            ent_BT = jax.lax.stop_gradient(ent_BT)
        # No old log-probs: the batch is on-policy, old = current without gradient.
        old_BT = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp_BT)
        return losses.packed_policy_loss(
            logp_BT, old_BT, mb["advantages"], mb["loss_mask"], mb["segment_ids"], denoms,
            loss_cfg, ref_logp_BT=mb.get("ref_logp"), rollout_logp_BT=mb.get("rollout_logp"),
            entropy_BT=ent_BT if compute_entropy else None)

    def micro_loss(params, mb):
        mb = _constrain(mb, mesh)
        if not (fused_head and loss_cfg.ratio_level == "token"):
            return terms(*_token_logprobs(model_cfg, params, mb, mesh, chunk, compute_entropy,
                                          packed, visual_table_RD), mb)
        x_BTD, w_DV = _hidden_and_unembedding(model_cfg, params, mb, mesh, packed,
                                              visual_table_RD)
        aux = losses.token_loss_aux(mb["loss_mask"], mb["segment_ids"], denoms, loss_cfg,
                                    adv_BT=mb["advantages"], old_logp_BT=mb.get("old_logp"),
                                    ref_logp_BT=mb.get("ref_logp"),
                                    rollout_logp_BT=mb.get("rollout_logp"))
        loss, logp_BT, ent_BT = fused_token_loss(
            x_BTD, w_DV, mb["targets"], functools.partial(losses.token_loss, cfg=loss_cfg), aux,
            chunk=chunk, compute_entropy=compute_entropy)
        return loss, terms(logp_BT, ent_BT, mb)[1]   # the metrics, from the same log-probs

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    micro = _micro_split(batch, num_micro)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    if mesh is not None:  # the accumulator lives sharded like the parameters
        zeros = jax.lax.with_sharding_constraint(
            zeros, models.param_shardings(model_cfg, mesh, state.params))
    first_mb = jax.tree.map(lambda x: x[0], micro)
    f32_BT = jax.ShapeDtypeStruct(first_mb["tokens"].shape, jnp.float32)
    metric_shapes = jax.eval_shape(terms, f32_BT, f32_BT, first_mb)[1]

    def body(carry, mb):
        g_acc, m_acc = carry
        (_, m), g = grad_fn(state.params, mb)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return (g_acc, losses.combine_metrics(m_acc, m)), None

    (grads, metrics), _ = jax.lax.scan(body, (zeros, _metric_identity(metric_shapes)), micro)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    lr = optim.learning_rate(opt_state)
    metrics.update(grad_norm=optax.global_norm(grads), update_norm=optax.global_norm(updates),
                   sequences=denoms.sequences)
    if lr is not None:
        metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return TrainState(state.step + 1, params, opt_state), metrics


def logprobs(params, batch, visual_table_RD=None, *, model_cfg, mesh=None, num_micro: int = 1,
             chunk: int = 1024):
    """Forward-only token log-probs [B, T] (fp32) of `batch["targets"]`: the old policy's
    or the reference's. Uses tokens, positions, segment_ids, targets (and visual_index with
    the visual table); other keys are ignored."""
    keys = ("tokens", "positions", "segment_ids", "targets")
    keys += ("visual_index",) if "visual_index" in batch else ()
    _check_batch(batch, num_micro, required=keys, optional=None)
    sub = {k: batch[k] for k in keys}

    def one(mb):
        return _token_logprobs(model_cfg, params, _constrain(mb, mesh), mesh, chunk, False,
                               visual_table_RD=visual_table_RD)[0]

    logp_MBT = jax.lax.map(one, _micro_split(sub, num_micro))
    return _micro_merge(logp_MBT)


# --- Building the compiled functions (once, where the loop is built) ---------------------

def init_train_state(params, tx) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def train_state_shardings(model_cfg, tx, mesh) -> TrainState:
    """Shardings of the train state, from shapes alone: optimizer leaves shaped like the
    parameters follow the parameters' sharding, the rest (counts, hyper-parameters) are
    replicated."""
    shapes = models.abstract_params(model_cfg)
    param_sh = models.param_shardings(model_cfg, mesh, shapes)
    opt_shapes = jax.eval_shape(tx.init, shapes)
    replicated = mesh_lib.replicated(mesh)
    opt_sh = optax.tree_utils.tree_map_params(
        tx, lambda _, sh: sh, opt_shapes, param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return TrainState(replicated, param_sh, opt_sh)


def abstract_train_state(model_cfg, tx, mesh) -> TrainState:
    """The train state as ShapeDtypeStructs carrying their shardings: what a checkpoint
    restore reads into."""
    shapes = models.abstract_params(model_cfg)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), shapes,
                          jax.eval_shape(tx.init, shapes))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        abstract, train_state_shardings(model_cfg, tx, mesh))


def make_init_fn(model_cfg, tx, mesh=None):
    """rng -> TrainState, every array created directly in its sharding."""
    def init(rng):
        return init_train_state(models.init_params(model_cfg, rng), tx)
    if mesh is None:
        return jax.jit(init)
    return jax.jit(init, out_shardings=train_state_shardings(model_cfg, tx, mesh))


def make_update_fn(model_cfg, loss_cfg, tx, mesh=None, *, num_micro: int = 1,
                   chunk: int = 1024, compute_entropy: bool = True, packed: bool = True,
                   fused_head: bool = True, uninit_scan: Optional[bool] = None):
    """update_step jitted once: the state is donated; with a mesh, the state keeps its
    sharding, batch rows go over (data, fsdp) and positions over seq, metrics are replicated.
    `uninit_scan`: see `jit_step`. Vision-language batches (`fn(state, batch, visual_table)`)
    on a mesh go through `lrl.vl_grpo.make_vl_update_fn`, which places the visual table
    replicated."""
    step = functools.partial(update_step, model_cfg=model_cfg, loss_cfg=loss_cfg, tx=tx,
                             mesh=mesh, num_micro=num_micro, chunk=chunk,
                             compute_entropy=compute_entropy, packed=packed,
                             fused_head=fused_head)
    return jit_step(step, model_cfg, tx, mesh, uninit_scan=uninit_scan)


def jit_step(step, model_cfg, tx, mesh=None, *, uninit_scan: Optional[bool] = None):
    """`step(state, batch) -> (state, metrics)` jitted once with the state donated; with a
    mesh the state keeps its sharding, batch rows go over (data, fsdp) and positions over seq,
    metrics are replicated. `uninit_scan` lowers it with the layer scan's stacked outputs
    (saved residuals, weight gradients) uninitialised, not zero-filled
    (`lrl.models.scan_buffers`). None: on one device only. Measured on H200s at 32K tokens:
    on one, 0.8 points of MFU more and the same peak memory; on two with ring attention over
    `seq`, no faster and 21-23 GiB more peak memory a device."""
    if uninit_scan is None:
        uninit_scan = mesh is None or mesh.size == 1
    if mesh is None:
        jitted = jax.jit(step, donate_argnums=(0,))
    else:
        state_sh = train_state_shardings(model_cfg, tx, mesh)
        jitted = jax.jit(step, in_shardings=(state_sh, mesh_lib.batch_sharding(mesh, 2)),
                         out_shardings=(state_sh, mesh_lib.replicated(mesh)),
                         donate_argnums=(0,))
    return UninitialisedScanJit(jitted) if uninit_scan else jitted


def make_logprobs_fn(model_cfg, mesh=None, *, num_micro: int = 1, chunk: int = 1024):
    """logprobs jitted once: (params, batch) -> logp_BT, sharded like the batch."""
    fn = functools.partial(logprobs, model_cfg=model_cfg, mesh=mesh, num_micro=num_micro,
                           chunk=chunk)
    if mesh is None:
        return jax.jit(fn)
    batch_sh = mesh_lib.batch_sharding(mesh, 2)
    return jax.jit(fn, in_shardings=(models.param_shardings(model_cfg, mesh), batch_sh),
                   out_shardings=batch_sh)
