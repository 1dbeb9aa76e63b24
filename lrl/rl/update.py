"""The policy update: a pure `update_step(state, batch) -> (state, metrics)` over packed rows,
jit-compiled once over the mesh by `make_update_fn`, and a forward-only `logprobs` pass for
old / reference log-probs.

A batch is a dict of [B, T] arrays (see `lrl.data.packing`):
  tokens, positions, segment_ids (0 = padding), targets (next token within the segment),
  loss_mask (1 where the target is a completion token), advantages (per token),
  old_logp (optional: absent means on-policy, ratio exactly 1), ref_logp (optional, for KL),
  rollout_logp (optional: the sampler's log-probs, for the rollout correction),
  sample_age (optional: each token's sample age in policy versions, for the staleness
  weight), prefix_ids (optional: rows in the shared-prompt layout of
  `lrl.data.shared_prompt`, where a group's prompt is held once and each response is its own
  segment, so the loss and its denominators read them as they read unshared rows).
The B rows are split into `num_micro` micro-batches whose gradients are added up
(`lrl.rl.train.accumulate_and_apply`); the loss denominators are computed once over all B
rows (all data shards: under jit the batch is one global array), so the step equals the
one-big-batch step.

The step knows no model family: `hidden(model_cfg, params, batch, extra, mesh, packed) ->
x_BTD` maps a micro-batch to final hidden states, given where the step is built (the text
decoder, `lrl.models.batch_hidden_states`, by default; the task chooses another, e.g. the
vision-language decoder reading a visual table). `extra` is the step's third argument,
passed to `hidden` unchanged and shared by all micro-batches (for a VL task, the visual
table, which gets no gradient); `extra_keys` names the batch arrays such a `hidden` reads
beyond the text ones. Positions may be [B, T] or, for M-RoPE, [B, 3, T].

Dimension letters: B batch rows · T positions · D model width · V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lrl import mesh as mesh_lib
from lrl import models
from lrl.rl import losses, mismatch
from lrl.rl.fused_head import fused_token_loss
from lrl.rl.logprobs import token_logprobs_and_entropy
from lrl.rl.train import (AccumulatePrograms, TrainState, abstract_train_state,  # noqa: F401
                          accumulate_and_apply, constrain_batch, init_train_state, jit_step,
                          make_accumulate_programs, make_init_fn, micro_merge, micro_split,
                          run_accumulated, train_state_shardings)

REQUIRED_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages")
OPTIONAL_KEYS = ("old_logp", "ref_logp", "rollout_logp", "sample_age", "prefix_ids",
                 "response_pos")
# The metrics of the sampler-trainer mismatch a micro-batch adds when it carries
# `response_pos`: `lrl.rl.mismatch.mismatch_sums` under this prefix (its maxima end in _max,
# so micro-batches combine as the sums do).
MISMATCH_SUMS = "mismatch_sums/"


def _check_batch(batch, num_micro: int, required=REQUIRED_KEYS, optional=OPTIONAL_KEYS):
    missing = [k for k in required if k not in batch]
    unknown = [k for k in batch if optional is not None and k not in required + optional]
    if missing or unknown:
        raise ValueError(f"update: batch is missing {missing} / has unknown keys {unknown}; "
                         f"keys are {required} and optionally {optional}")
    shape = batch["tokens"].shape
    mrope = batch["positions"].ndim == 3   # positions [B, 3, T]
    want = lambda k: (shape[0], 3, shape[1]) if mrope and k == "positions" else shape  # noqa: E731
    bad = {k: v.shape for k, v in batch.items() if v.shape != want(k) or len(shape) != 2}
    if bad:
        raise ValueError(f"update: every batch array must be [B, T] = {shape}, got {bad}")
    if num_micro < 1 or shape[0] % num_micro:
        raise ValueError(f"update: {shape[0]} rows do not split into num_micro={num_micro} "
                         "micro-batches")


def _hidden_and_unembedding(model_cfg, params, mb, mesh, hidden, extra, packed=True):
    """Final hidden states x_BTD and the unembedding w_DV in the compute dtype."""
    # packed=False: every row is one sequence, so attention needs no segment mask (cuDNN's
    # plain causal kernel instead of its packed layout); the loss still reads segment_ids.
    x_BTD = hidden(model_cfg, params, mb, extra, mesh, packed)
    w_DV = models.unembedding(model_cfg, params).astype(x_BTD.dtype)
    if mesh is not None:
        # Gather D (fsdp) once, before the chunk loop, instead of once per chunk inside it;
        # V stays split over tensor where it divides.
        v_axis = "tensor" if w_DV.shape[1] % mesh.shape["tensor"] == 0 else None
        w_DV = jax.lax.with_sharding_constraint(w_DV, NamedSharding(mesh, P(None, v_axis)))
    return x_BTD, w_DV


def token_logprobs(model_cfg, params, mb, mesh, chunk, compute_entropy, *, packed=True,
                   hidden: Callable = models.batch_hidden_states, extra=None):
    """Per-token log-probs (and entropies) [B, T] of `mb["targets"]`, in vocabulary chunks."""
    x_BTD, w_DV = _hidden_and_unembedding(model_cfg, params, mb, mesh, hidden, extra, packed)
    return token_logprobs_and_entropy(x_BTD, w_DV, mb["targets"].astype(jnp.int32),
                                      chunk=chunk, compute_entropy=compute_entropy)


@dataclasses.dataclass(frozen=True)
class Objective:
    """How a micro-batch's loss is computed: the loss options and the model's forward."""
    model_cfg: object
    loss_cfg: losses.LossConfig
    mesh: object = None
    chunk: int = 1024
    compute_entropy: bool = True
    packed: bool = True
    fused_head: bool = True
    hidden: Callable = models.batch_hidden_states

    def __post_init__(self):
        if self.loss_cfg.entropy_coef != 0.0 and not self.compute_entropy:
            raise ValueError("update: entropy_coef != 0 needs compute_entropy=True")


def micro_loss(params, mb, denoms: losses.Denominators, extra=None, *, objective: Objective):
    """One micro-batch's share of the minibatch's policy loss -> (loss, metrics); `denoms`
    are the whole minibatch's (`losses.loss_denominators`, or `host_denominators`), so the
    shares add up to the minibatch's loss, gradient and metrics."""
    o, cfg = objective, objective.loss_cfg
    mb = constrain_batch(mb, o.mesh)
    # The sampler's log-probs reach the loss only for its rollout correction; else they ride
    # along for the mismatch metrics.
    rollout_BT = mb.get("rollout_logp") if cfg.corrects_rollout else None

    def terms(logp_BT, ent_BT):
        if cfg.entropy_coef == 0.0:
            ent_BT = jax.lax.stop_gradient(ent_BT)
        # No old log-probs: the batch is on-policy, old = current without gradient.
        old_BT = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp_BT)
        loss, metrics = losses.packed_policy_loss(
            logp_BT, old_BT, mb["advantages"], mb["loss_mask"], mb["segment_ids"], denoms,
            cfg, ref_logp_BT=mb.get("ref_logp"), rollout_logp_BT=rollout_BT,
            age_BT=mb.get("sample_age"), entropy_BT=ent_BT if o.compute_entropy else None)
        return loss, dict(metrics, **_mismatch_sums(mb, logp_BT))

    if not (o.fused_head and cfg.ratio_level == "token"):
        return terms(*token_logprobs(o.model_cfg, params, mb, o.mesh, o.chunk, o.compute_entropy,
                                     packed=o.packed, hidden=o.hidden, extra=extra))
    x_BTD, w_DV = _hidden_and_unembedding(o.model_cfg, params, mb, o.mesh, o.hidden, extra,
                                          o.packed)
    aux = losses.token_loss_aux(mb["loss_mask"], mb["segment_ids"], denoms, cfg,
                                adv_BT=mb["advantages"], old_logp_BT=mb.get("old_logp"),
                                ref_logp_BT=mb.get("ref_logp"),
                                rollout_logp_BT=rollout_BT, age_BT=mb.get("sample_age"))
    loss, logp_BT, ent_BT = fused_token_loss(
        x_BTD, w_DV, mb["targets"], functools.partial(losses.token_loss, cfg=cfg), aux,
        chunk=o.chunk, compute_entropy=o.compute_entropy)
    return loss, terms(logp_BT, ent_BT)[1]   # the metrics, from the same log-probs


def _mismatch_sums(mb, logp_BT) -> dict:
    """The mismatch sums of the micro-batch's own forward (trainer log-probs under the params
    it is called with) against the sampler's, when the rows carry `response_pos` (1-based, 0
    off the responses): free where the update's first minibatch runs under the weights that
    sampled, instead of a forward pass of its own."""
    if "response_pos" not in mb:
        return {}
    sampler_BT = mb["rollout_logp"] if "rollout_logp" in mb else mb["old_logp"]
    sums = mismatch.row_sums(jax.lax.stop_gradient(logp_BT), sampler_BT, mb["response_pos"])
    return {MISMATCH_SUMS + k: v for k, v in sums.items()}


def mismatch_of(metrics: dict) -> tuple[dict, dict]:
    """An update's metrics -> (those without the mismatch sums, the sums by their own keys)."""
    rest = {k: v for k, v in metrics.items() if not k.startswith(MISMATCH_SUMS)}
    return rest, {k[len(MISMATCH_SUMS):]: v for k, v in metrics.items()
                  if k.startswith(MISMATCH_SUMS)}


def host_denominators(micro_batches, max_len: Optional[int] = None) -> losses.Denominators:
    """`losses.loss_denominators` of a minibatch held as host micro-batches (numpy [B, T]
    loss_mask and segment_ids each), without putting them on the devices together. A
    sequence lies within one row, so each row's segments are counted where they are (in the
    shared-prompt layout a response is a segment and its prefix, with no loss token, is
    none)."""
    tokens = sequences = 0.0
    for mb in micro_batches:
        seg = np.asarray(mb["segment_ids"])
        mask = np.where(seg > 0, np.asarray(mb["loss_mask"], np.float32), 0.0)
        tokens += float(mask.sum())
        for r in range(seg.shape[0]):
            sums = np.bincount(seg[r], weights=mask[r], minlength=1)
            sequences += float((sums[1:] > 0).sum())
    sum_norm = sequences * (max_len if max_len is not None else np.nan)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return losses.Denominators(f32(tokens), f32(sequences), f32(sum_norm))


def update_step(state: TrainState, batch, extra=None, *, model_cfg,
                loss_cfg: losses.LossConfig, tx, mesh=None, num_micro: int = 1,
                chunk: int = 1024, compute_entropy: bool = True, packed: bool = True,
                fused_head: bool = True, hidden: Callable = models.batch_hidden_states,
                extra_keys: tuple = ()):
    """One optimizer step on a minibatch of packed rows, in one program -> (new state,
    metrics): the reference form of `make_update_programs`' host-driven step.

    Gradients are taken with respect to the master params (the model casts them to
    cfg.dtype for compute) and accumulated in their dtype over `num_micro` micro-batches.
    `compute_entropy` adds the (cheap) entropy metric; it is needed when
    loss_cfg.entropy_coef != 0. `fused_head` forms the loss's gradient in the lm head's
    forward pass (`lrl.rl.fused_head`: no logits recomputed) when the ratios are per token;
    GSPO's sequence ratios always take the unfused path. `hidden`, `extra` and `extra_keys`:
    see the module docstring.
    """
    _check_batch(batch, num_micro, optional=OPTIONAL_KEYS + tuple(extra_keys))
    objective = Objective(model_cfg, loss_cfg, mesh, chunk, compute_entropy, packed, fused_head,
                          hidden)
    denoms = losses.loss_denominators(batch["loss_mask"], batch["segment_ids"], loss_cfg.max_len)
    loss_fn = lambda p, mb: micro_loss(p, mb, denoms, extra, objective=objective)  # noqa: E731
    state, metrics = accumulate_and_apply(state, batch, loss_fn, model_cfg=model_cfg, tx=tx,
                                          mesh=mesh, num_micro=num_micro)
    metrics["sequences"] = denoms.sequences
    return state, metrics


def logprobs(params, batch, extra=None, *, model_cfg, mesh=None, num_micro: int = 1,
             chunk: int = 1024, hidden: Callable = models.batch_hidden_states,
             extra_keys: tuple = ()):
    """Forward-only token log-probs [B, T] (fp32) of `batch["targets"]`: the old policy's
    or the reference's. Uses tokens, positions, segment_ids, targets, prefix_ids (when
    there) and `extra_keys`; other keys are ignored."""
    keys = ("tokens", "positions", "segment_ids", "targets") + tuple(
        k for k in ("prefix_ids",) + tuple(extra_keys) if k in batch)
    _check_batch(batch, num_micro, required=keys, optional=None)
    sub = {k: batch[k] for k in keys}

    def one(mb):
        return token_logprobs(model_cfg, params, constrain_batch(mb, mesh), mesh, chunk, False,
                              hidden=hidden, extra=extra)[0]

    logp_MBT = jax.lax.map(one, micro_split(sub, num_micro))
    return micro_merge(logp_MBT)


# --- Building the compiled functions (once, where the loop is built) ---------------------

def make_update_fn(model_cfg, loss_cfg, tx, mesh=None, *, num_micro: int = 1,
                   chunk: int = 1024, compute_entropy: bool = True, packed: bool = True,
                   fused_head: bool = True, uninit_scan: Optional[bool] = None,
                   hidden: Callable = models.batch_hidden_states, extra_keys: tuple = ()):
    """update_step jitted once: `fn(state, batch[, extra]) -> (state, metrics)`, the state
    donated; with a mesh, the state keeps its sharding, the batch the sharding
    `lrl.mesh.put_batch` gave it, and metrics are replicated. `uninit_scan`: see
    `lrl.rl.train.jit_step`."""
    step = functools.partial(update_step, model_cfg=model_cfg, loss_cfg=loss_cfg, tx=tx,
                             mesh=mesh, num_micro=num_micro, chunk=chunk,
                             compute_entropy=compute_entropy, packed=packed,
                             fused_head=fused_head, hidden=hidden, extra_keys=tuple(extra_keys))
    return jit_step(step, model_cfg, tx, mesh, uninit_scan=uninit_scan)


class UpdatePrograms(NamedTuple):
    """The policy update, compiled once per micro-batch shape and driven from the host:
    `run_update(programs, state, micro_batches, extra)` is one optimizer step over however
    many micro-batches the minibatch has, of any of the run's shapes
    (`lrl.rl.train.AccumulatePrograms`)."""
    programs: AccumulatePrograms
    objective: Objective
    extra_keys: tuple


def make_update_programs(model_cfg, loss_cfg, tx, mesh=None, *, chunk: int = 1024,
                         compute_entropy: bool = True, packed: bool = True,
                         fused_head: bool = True, uninit_scan: Optional[bool] = None,
                         hidden: Callable = models.batch_hidden_states,
                         extra_keys: tuple = (), grad_sink: bool = False) -> UpdatePrograms:
    objective = Objective(model_cfg, loss_cfg, mesh, chunk, compute_entropy, packed, fused_head,
                          hidden)
    loss_fn = functools.partial(micro_loss, objective=objective)
    return UpdatePrograms(make_accumulate_programs(loss_fn, model_cfg, tx, mesh,
                                                   uninit_scan=uninit_scan,
                                                   grad_sink=grad_sink),
                          objective, tuple(extra_keys))


def run_update(u: UpdatePrograms, state: TrainState, micro_batches, denoms, extra=None):
    """One optimizer step over `micro_batches` (placed on the devices, each of any of the
    run's shapes) of a minibatch whose denominators are `denoms` (`host_denominators`) ->
    (state, metrics)."""
    for mb in micro_batches:
        _check_batch(mb, 1, optional=OPTIONAL_KEYS + u.extra_keys)
    state, metrics = run_accumulated(u.programs, state, micro_batches, denoms, extra)
    metrics["sequences"] = denoms.sequences
    return state, metrics


def compile_shapes(u: UpdatePrograms, params, micro_batches, denoms, extra=None) -> None:
    """Runs `accumulate` on each of `micro_batches` into an accumulator then dropped: their
    shapes compile (ahead of a step that needs them) and no optimizer step is taken."""
    for mb in micro_batches:
        _check_batch(mb, 1, optional=OPTIONAL_KEYS + u.extra_keys)
        u.programs.accumulate(params, u.programs.start(params, mb, denoms, extra), mb, denoms,
                              extra)


def need_bytes(u: UpdatePrograms, params, mb_spec: dict, extra_spec=None) -> int:
    """Bytes one device needs to run `accumulate` on micro-batches shaped `mb_spec`
    (ShapeDtypeStructs), beyond the parameters it is given (which are live anyway): the
    accumulator (donated, so counted once) and the program's temporaries; compiled, not run
    (`lrl.rl.budget`)."""
    from lrl.rl.budget import program_bytes
    params = jax.tree.map(_abstract, params)
    acc = _abstract_accumulator(u, params, mb_spec, extra_spec)
    compiled = u.programs.accumulate.lower(params, acc, mb_spec, _DENOMS, extra_spec).compile()
    return program_bytes(compiled) - _device_bytes(params)


def apply_bytes(u: UpdatePrograms, state: TrainState, mb_spec: dict, extra_spec=None) -> int:
    """Bytes one device needs to run `apply` beyond the train state it is given (donated,
    written in place): the accumulator, live from a step's first micro-batch to its optimizer
    step, and the step's temporaries. The same for every micro-batch shape (`mb_spec` only
    gives the accumulator's metrics their structure); an update needs the larger of this and
    `need_bytes`."""
    from lrl.rl.budget import program_bytes
    state = jax.tree.map(_abstract, state)
    acc = _abstract_accumulator(u, state.params, mb_spec, extra_spec)
    compiled = u.programs.apply.lower(state, acc).compile()
    return program_bytes(compiled) - _device_bytes(state)


_F32 = jax.ShapeDtypeStruct((), jnp.float32)
_DENOMS = losses.Denominators(_F32, _F32, _F32)


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _abstract_accumulator(u: UpdatePrograms, params, mb_spec, extra_spec):
    return u.programs.start.abstract(params, mb_spec, _DENOMS, extra_spec)


def _device_bytes(tree) -> int:
    """Bytes of `tree` on one device; leaves in host memory (an offloaded optimizer's) none."""
    return sum(x.size * x.dtype.itemsize // _shards(x) for x in jax.tree.leaves(tree)
               if getattr(getattr(x, "sharding", None), "memory_kind", None) != "pinned_host")


def _shards(x) -> int:
    sh = getattr(x, "sharding", None)
    if sh is None or not hasattr(sh, "shard_shape"):
        return 1
    shard = sh.shard_shape(x.shape)
    return max(1, (x.size // max(1, int(np.prod(shard)))) if x.size else 1)


def make_logprobs_fn(model_cfg, mesh=None, *, num_micro: int = 1, chunk: int = 1024,
                     hidden: Callable = models.batch_hidden_states, extra_keys: tuple = ()):
    """logprobs jitted once: (params, batch[, extra]) -> logp_BT, sharded like the batch."""
    fn = functools.partial(logprobs, model_cfg=model_cfg, mesh=mesh, num_micro=num_micro,
                           chunk=chunk, hidden=hidden, extra_keys=tuple(extra_keys))
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=mesh_lib.batch_sharding(mesh, 2))
