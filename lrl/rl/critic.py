"""The critic of PPO: the policy's decoder with a scalar value head, trained by verl's clipped
value loss over the same packed rows, on the same mesh, with the same sharding rules,
attention (ring / Ulysses over `seq`), scanned layers, remat policy and token-budget
micro-batches as the policy's update (`lrl.rl.train`'s skeleton: one `accumulate` program per
micro-batch shape, `start` and `apply` once).

Parameters (this is also the checkpoint's `critic` item, a `TrainState` whose `params` are):

    {"decoder":  the decoder's tree (`lrl.models`) without an lm head: the critic's model
                 config is the policy's with `tie_embeddings=True`, so none is made,
     "score_DL": [D, 1] float, the value head (HF's `score.weight` transposed),
     "score_L":  [1] float, its bias (HF's `score.bias` of a *ForTokenClassification head;
                 0 from the policy or a bias-free *ForSequenceClassification one)}

A token's value is `x_BTD @ score_DL` at the position whose TARGET is the token: the value of
the state the policy acts from (verl's `values[:, -response_length - 1:-1]`), aligned with the
log-probs and the loss mask of `lrl.data.packing`.

A micro-batch of the critic's update reads tokens, positions, segment_ids (prefix_ids in the
shared-prompt layout, and the task's extra keys), loss_mask, old_values (the critic's values
before this step's updates) and returns (GAE's), with the policy's loss denominators.

B batch rows · T positions · D model width · L labels (1).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lrl import mesh as mesh_lib
from lrl import models
from lrl.rl import train as train_lib
from lrl.rl.train import TrainState, constrain_batch

ROW_KEYS = ("tokens", "positions", "segment_ids")
LOSS_KEYS = ("loss_mask", "old_values", "returns")


def critic_config(model_cfg, remat: str = ""):
    """The critic decoder's config: the policy's without an lm head (tied embeddings make
    none) and, when given, its own remat policy."""
    cfg = model_cfg.replace(tie_embeddings=True)
    return cfg.replace(remat=remat) if remat else cfg


def abstract_params(cfg):
    """The critic's parameters as ShapeDtypeStructs (`cfg`: `critic_config`'s)."""
    return {"decoder": models.abstract_params(cfg),
            "score_DL": jax.ShapeDtypeStruct((cfg.d_model, 1), cfg.param_dtype),
            "score_L": jax.ShapeDtypeStruct((1,), cfg.param_dtype)}


def param_shardings(cfg, mesh):
    """The decoder's shardings (`lrl.mesh.PARAM_RULES`); the [D, 1] head is replicated."""
    return {"decoder": models.param_shardings(cfg, mesh),
            "score_DL": mesh_lib.replicated(mesh), "score_L": mesh_lib.replicated(mesh)}


def state_shardings(cfg, tx, mesh) -> TrainState:
    return train_lib.state_shardings(tx, param_shardings(cfg, mesh), mesh, abstract_params(cfg))


def abstract_state(cfg, tx, mesh) -> TrainState:
    """The critic's train state as ShapeDtypeStructs with their shardings (a restore's
    target)."""
    shapes = abstract_params(cfg)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), shapes,
                          jax.eval_shape(tx.init, shapes))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        abstract, state_shardings(cfg, tx, mesh))


def params_from_policy(cfg, policy_params, head_std: float = 0.0, seed: int = 0):
    """The critic initialised from the policy's parameters (copied; an untied lm head
    dropped) with the head at zero, or drawn from N(0, head_std²)."""
    decoder = {k: jax.tree.map(lambda x: x.copy(), v) for k, v in policy_params.items()
               if k != "lm_head"}
    shape = (cfg.d_model, 1)
    head = (np.random.default_rng(seed).normal(0.0, head_std, shape) if head_std
            else np.zeros(shape))
    return {"decoder": decoder, "score_DL": jnp.asarray(head, cfg.param_dtype),
            "score_L": jnp.zeros((1,), cfg.param_dtype)}


def init_state(cfg, params, tx, mesh=None) -> TrainState:
    """The critic's train state on `params`, every leaf in its sharding."""
    state = TrainState(np.zeros((), np.int32), params, tx.init(params))
    return jax.device_put(state, state_shardings(cfg, tx, mesh)) if mesh is not None else state


# ----------------------------------------------------------------------------- the programs

def values(cfg, params, mb, mesh=None, *, hidden: Callable = models.batch_hidden_states,
           extra=None):
    """float32 values [B, T] of a micro-batch of packed rows (`cfg`: `critic_config`'s)."""
    x_BTD = hidden(cfg, params["decoder"], constrain_batch(mb, mesh), extra, mesh, True)
    v_BTL = jnp.einsum("btd,dl->btl", x_BTD, params["score_DL"].astype(x_BTD.dtype),
                       preferred_element_type=jnp.float32)
    return (v_BTL + params["score_L"].astype(jnp.float32))[..., 0]


def _values(params, mb, extra=None, *, cfg, mesh, hidden):
    return values(cfg, params, mb, mesh, hidden=hidden, extra=extra)


@dataclasses.dataclass(frozen=True)
class ValueObjective:
    """How a micro-batch's value loss is computed."""
    model_cfg: object
    cliprange_value: float
    aggregation: str
    mesh: object = None
    hidden: Callable = models.batch_hidden_states


def micro_loss(params, mb, denoms, extra=None, *, objective: ValueObjective):
    """One micro-batch's share of the minibatch's value loss (verl's clipped value loss,
    `lrl.rl.values.packed_value_loss`) -> (loss, metrics)."""
    from lrl.rl.values import packed_value_loss
    o = objective
    v_BT = values(o.model_cfg, params, mb, o.mesh, hidden=o.hidden, extra=extra)
    return packed_value_loss(v_BT, mb["old_values"], mb["returns"], mb["loss_mask"],
                             mb["segment_ids"], denoms, o.cliprange_value, o.aggregation)


class CriticPrograms(NamedTuple):
    """The critic's programs, built once: `programs` (start / accumulate / apply, as the
    policy update's, so `lrl.rl.update.need_bytes` measures them), `values(params, mb,
    extra) -> v_BT` (forward only, once per shape), and what selects a micro-batch's keys."""
    programs: train_lib.AccumulatePrograms
    values: Callable
    objective: ValueObjective
    extra_keys: tuple
    cfg: object


def make_programs(cfg, tx, mesh=None, *, cliprange_value: float, aggregation: str,
                  hidden: Callable = models.batch_hidden_states,
                  extra_keys: tuple = ()) -> CriticPrograms:
    """The critic's jitted programs (`cfg`: `critic_config`'s)."""
    objective = ValueObjective(cfg, cliprange_value, aggregation, mesh, hidden)
    loss_fn = functools.partial(micro_loss, objective=objective)
    kw = {} if mesh is None else dict(param_sh=param_shardings(cfg, mesh),
                                      state_sh=state_shardings(cfg, tx, mesh))
    programs = train_lib.make_accumulate_programs(loss_fn, cfg, tx, mesh, **kw)
    fwd = functools.partial(_values, cfg=cfg, mesh=mesh, hidden=hidden)
    jitted = (jax.jit(fwd) if mesh is None
              else jax.jit(fwd, out_shardings=mesh_lib.batch_sharding(mesh, 2)))
    return CriticPrograms(programs, jitted, objective, tuple(extra_keys), cfg)


def forward_inputs(c: CriticPrograms, mb: dict) -> dict:
    """The arrays of a micro-batch the critic's forward reads."""
    keys = ROW_KEYS + tuple(k for k in ("prefix_ids",) + c.extra_keys if k in mb)
    return {k: mb[k] for k in keys}


def loss_inputs(c: CriticPrograms, mb: dict) -> dict:
    """The arrays of a micro-batch the critic's update reads."""
    return {**forward_inputs(c, mb), **{k: mb[k] for k in LOSS_KEYS}}


def old_values(c: CriticPrograms, params, mb: dict, extra=None):
    return c.values(params, forward_inputs(c, mb), extra)


def run_update(c: CriticPrograms, state: TrainState, micro_batches, denoms, extra=None):
    """One optimizer step of the critic over a minibatch's micro-batches -> (state, metrics)."""
    return train_lib.run_accumulated(c.programs, state, [loss_inputs(c, mb) for mb in
                                                         micro_batches], denoms, extra)


def compile_shapes(c: CriticPrograms, params, micro_batches, denoms, extra=None) -> None:
    """`accumulate` on each micro-batch into an accumulator then dropped: its shapes compile
    ahead of the step that needs them, and no optimizer step is taken."""
    for mb in micro_batches:
        mb = loss_inputs(c, mb)
        c.programs.accumulate(params, c.programs.start(params, mb, denoms, extra), mb, denoms,
                              extra)
