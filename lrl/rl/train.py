"""What every training objective shares: the train state, its shardings, accumulating the
gradients of micro-batches and applying one optimizer update, and jitting such steps once
over the mesh. The policy update (`lrl.rl.update`) and SFT (`lrl.rl.sft`) are each a
micro-batch loss handed to this skeleton, in one of two forms:

- `accumulate_and_apply`: one program over a whole batch, its micro-batches summed by a
  `lax.scan` (the batch's shape is the program's);
- `AccumulatePrograms`: three programs driven from the host (`run_accumulated`): `start`
  zeroes an accumulator (compiled once), `accumulate` adds one micro-batch's gradient and
  metrics into it (compiled once per micro-batch shape), `apply` takes the optimizer step
  (once). A step's number of micro-batches, and of each shape, can change from step to step
  without a compile.

Both give the one-big-batch gradient when the micro-batch losses are normalised by the whole
batch (token and sequence counts taken once over all of it).

B batch rows · T positions · M micro-batches.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from lrl import mesh as mesh_lib
from lrl import models
from lrl.models import grad_sink
from lrl.models.scan_buffers import UninitialisedScanJit
from lrl.rl import offload as offload_lib
from lrl.rl import optim
from lrl.rl.losses import combine_metrics


class TrainState(NamedTuple):
    step: jax.Array   # int32 scalar: updates applied so far
    params: Any       # master weights, in cfg.param_dtype (fp32 for training)
    opt_state: Any


def micro_split(batch, num_micro: int):
    """[B, ...] -> [M, B/M, ...], micro-batch m = rows m, m+M, m+2M, ...: rows are sharded in
    contiguous blocks, so every micro-batch keeps rows on every data shard."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num_micro, *x.shape[1:]), 0, 1),
                        batch)


def micro_merge(x_MB):
    return jnp.swapaxes(x_MB, 0, 1).reshape(-1, *x_MB.shape[2:])


def constrain_batch(batch: dict, mesh):
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


def _metric_identity(shapes):
    """Start values for combining micro-batch metrics: +inf for mins, -inf for maxes, else 0."""
    return {k: jnp.full(s.shape, jnp.inf if k.endswith("_min") else
                        -jnp.inf if k.endswith("_max") else 0.0, s.dtype)
            for k, s in shapes.items()}


def _finish(state: TrainState, grads, metrics, tx):
    """The optimizer step on the accumulated gradients -> (new state, metrics); with the
    optimizer offloaded (`lrl.rl.offload`) streamed through the device layer by layer."""
    if offload_lib.is_offload(tx):
        params, opt_state, grad_norm, update_norm = offload_lib.finish(state, grads, tx)
    else:
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm, update_norm = optax.global_norm(grads), optax.global_norm(updates)
    metrics = dict(metrics, grad_norm=grad_norm, update_norm=update_norm)
    lr = optim.learning_rate(opt_state)
    if lr is not None:
        metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return TrainState(state.step + 1, params, opt_state), metrics


def _zero_grads(model_cfg, params, mesh, param_sh=None, dtype=None):
    """The gradient accumulator: zeros in the masters' dtype, as the Adam moments (fp32
    masters accumulate in fp32; bf16 ones, whose gradients and moments are bf16, in bf16: an
    fp32 accumulator would be twice their size, 30 GB for a 7B model). `param_sh`: the
    parameters' shardings when they are not the decoder's own tree (the critic's). `dtype`:
    the masters' when `params` are not them (offloaded, `params` are the compute copy)."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype or p.dtype), params)
    if mesh is not None:  # the accumulator lives sharded like the parameters
        zeros = jax.lax.with_sharding_constraint(
            zeros, param_sh if param_sh is not None
            else models.param_shardings(model_cfg, mesh, params))
    return zeros


def accumulate_and_apply(state: TrainState, batch, micro_loss: Callable, *, model_cfg, tx,
                         mesh=None, num_micro: int = 1):
    """One optimizer update from the gradient of `micro_loss(params, mb) -> (loss, metrics)`
    summed over the `num_micro` micro-batches of `batch` -> (new state, metrics).

    The micro-batch losses must already be normalised by the whole batch (token counts taken
    once over all of it), so the sum is the one-big-batch gradient. Gradients are taken with
    respect to the master params and accumulated in their dtype, sharded like them; metrics
    combine by `losses.combine_metrics` (mins, maxes, sums)."""
    if num_micro < 1 or batch["tokens"].shape[0] % num_micro:
        raise ValueError(f"{batch['tokens'].shape[0]} rows do not split into "
                         f"num_micro={num_micro} micro-batches")
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    micro = micro_split(batch, num_micro)
    zeros = _zero_grads(model_cfg, state.params, mesh, dtype=grad_dtype(tx))
    first = jax.tree.map(lambda x: x[0], micro)
    metric_shapes = jax.eval_shape(micro_loss, state.params, first)[1]

    def body(carry, mb):
        g_acc, m_acc = carry
        (_, m), g = grad_fn(state.params, mb)
        g_acc = _added(g_acc, g)
        return (g_acc, combine_metrics(m_acc, m)), None

    (grads, metrics), _ = jax.lax.scan(body, (zeros, _metric_identity(metric_shapes)), micro)
    return _finish(state, grads, metrics, tx)


# --- Micro-batches driven from the host --------------------------------------------------

class Accumulator(NamedTuple):
    grads: Any        # in the masters' dtype, sharded like them
    metrics: dict     # combined by `losses.combine_metrics`


class AccumulatePrograms(NamedTuple):
    """start(params, mb, *args) -> Accumulator; accumulate(params, acc, mb, *args) -> acc
    (acc donated); apply(state, acc) -> (state, metrics) (the state donated; the accumulator
    has no output of its shape to alias, and is dropped by the caller). `*args` are the
    micro-batch loss's other arguments (e.g. the batch's loss denominators, a visual table)."""
    start: Callable
    accumulate: Callable
    apply: Callable


def _start(params, *, metric_shapes, model_cfg, mesh, param_sh=None, dtype=None):
    return Accumulator(_zero_grads(model_cfg, params, mesh, param_sh, dtype),
                       _metric_identity(metric_shapes))


class _Start:
    """`start(params, mb, *args)` in one program whatever the micro-batch's shape: a minibatch
    may begin with any of the run's shapes, and the accumulator (the parameters' shapes,
    scalar metrics) is the same for all. The metrics' structure is traced, not compiled,
    from the first micro-batch of each set of arrays."""

    def __init__(self, micro_loss, model_cfg, mesh, out_shardings, dtype=None):
        self._micro_loss, self._model_cfg, self._mesh = micro_loss, model_cfg, mesh
        self._dtype = dtype
        self._out_shardings, self._programs = out_shardings, {}

    def __call__(self, params, mb, *args):
        key = (tuple(sorted(mb)), jax.tree.structure(args))
        if key not in self._programs:
            shapes = jax.eval_shape(self._micro_loss, params, mb, *args)[1]
            fn = functools.partial(_start, metric_shapes=shapes, model_cfg=self._model_cfg,
                                   mesh=self._mesh, param_sh=(
                                       None if self._out_shardings is None
                                       else self._out_shardings.grads), dtype=self._dtype)
            self._programs[key] = (jax.jit(fn) if self._out_shardings is None
                                   else jax.jit(fn, out_shardings=self._out_shardings))
        return self._programs[key](params)

    def abstract(self, params, mb, *args):
        """What `self(params, mb, *args)` returns, as ShapeDtypeStructs with the shardings the
        program gives it. `accumulate` compiled on these (to read its memory, `lrl.rl.budget`)
        is then the very program a step runs, which the persistent cache serves it; without
        the shardings it was another program, compiled again in step 1."""
        shapes = jax.eval_shape(self, params, mb, *args)
        if self._out_shardings is None:
            return shapes
        return jax.tree.map(lambda sh, part: jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), part),
            self._out_shardings, shapes)


def _accumulate(params, acc: Accumulator, mb, *args, micro_loss, mesh, sink: bool = False):
    if sink and isinstance(params, dict) and "layers" in params:
        out = _accumulate_into(params, acc, mb, args, micro_loss)
        if out is not None:
            return out
    (_, m), g = jax.value_and_grad(micro_loss, has_aux=True)(params, mb, *args)
    return Accumulator(_added(acc.grads, g), combine_metrics(acc.metrics, m))


def _added(acc, grads):
    """The accumulator plus a micro-batch's gradients, in the accumulator's dtype."""
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, grads)


def _accumulate_into(params, acc: Accumulator, mb, args, micro_loss):
    """`_accumulate` with the scanned layers' gradients added into the accumulator inside
    the backward (`lrl.models.grad_sink`), or None when the loss's decoder did not take them
    (another tree of weights, no scanned layers) or read the layers twice: the caller then
    differentiates as usual.
    The layers' weights are not differentiated; the accumulator's layers are, and their
    gradient is the new accumulator."""
    layers = params["layers"]
    rest = {k: v for k, v in params.items() if k != "layers"}
    sinks = []

    def loss_of(rest_params, acc_L):
        with grad_sink.into(acc_L, layers) as s:
            sinks.append(s)
            return micro_loss({**rest_params, "layers": layers}, mb, *args)

    (_, m), (g_rest, acc_L) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
        rest, acc.grads["layers"])
    if not sinks[0].used:
        return None
    grads = {k: acc_L if k == "layers" else _added(acc.grads[k], g_rest[k]) for k in params}
    return Accumulator(grads, combine_metrics(acc.metrics, m))


def _apply(state: TrainState, acc: Accumulator, *, tx):
    return _finish(state, acc.grads, acc.metrics, tx)


def make_accumulate_programs(micro_loss: Callable, model_cfg, tx, mesh=None, *,
                             uninit_scan: Optional[bool] = None,
                             param_sh=None, state_sh=None,
                             grad_sink: bool = False) -> AccumulatePrograms:
    """The three programs for `micro_loss(params, mb, *args) -> (loss, metrics)`, jitted once:
    `accumulate` compiles once per micro-batch shape, the others once. With a mesh the
    accumulator's gradients keep the parameters' sharding, the state keeps its own, metrics
    are replicated. `uninit_scan`: as `jit_step`, for `accumulate` (the program that runs the
    layer scans). `param_sh`, `state_sh`: the parameters' and the train state's shardings
    when the parameters are not the decoder's tree of `model_cfg` (the critic's: the decoder
    and a value head, `lrl.rl.critic`)."""
    if uninit_scan is None:
        uninit_scan = mesh is None or mesh.size == 1
    acc = functools.partial(_accumulate, micro_loss=micro_loss, mesh=mesh, sink=grad_sink)
    gdt = grad_dtype(tx)
    apply = functools.partial(_apply, tx=tx)
    if mesh is None:
        jit_acc = jax.jit(acc, donate_argnums=(1,))
        programs = AccumulatePrograms(_Start(micro_loss, model_cfg, mesh, None, gdt), jit_acc,
                                      jax.jit(apply, donate_argnums=(0,)))
    else:
        rep = mesh_lib.replicated(mesh)
        grads_sh = models.param_shardings(model_cfg, mesh) if param_sh is None else param_sh
        acc_sh = Accumulator(grads_sh, rep)
        state_sh = train_state_shardings(model_cfg, tx, mesh) if state_sh is None else state_sh
        jit_acc = jax.jit(acc, donate_argnums=(1,), out_shardings=acc_sh)
        programs = AccumulatePrograms(_Start(micro_loss, model_cfg, mesh, acc_sh, gdt), jit_acc,
                                      jax.jit(apply, donate_argnums=(0,),
                                              out_shardings=(state_sh, rep)))
    if uninit_scan:
        programs = programs._replace(accumulate=UninitialisedScanJit(programs.accumulate))
    return programs


def run_accumulated(programs: AccumulatePrograms, state: TrainState, micro_batches: Sequence,
                    *args):
    """One optimizer update over `micro_batches` (already placed on the devices) -> (new
    state, metrics): one `accumulate` call each, then `apply`."""
    if not micro_batches:
        raise ValueError("run_accumulated: no micro-batches")
    acc = programs.start(state.params, micro_batches[0], *args)
    for mb in micro_batches:
        acc = programs.accumulate(state.params, acc, mb, *args)
    return programs.apply(state, acc)


# --- Building the compiled functions (once, where the loop is built) ---------------------

def grad_dtype(tx):
    """The gradient accumulator's dtype when it is not the params' (offloaded: the masters')."""
    return tx.master_dtype if offload_lib.is_offload(tx) else None


def init_train_state(params, tx) -> TrainState:
    """A fresh state on master `params` (offloaded: the compute copy and the host state)."""
    if offload_lib.is_offload(tx):
        return TrainState(jnp.zeros((), jnp.int32), *offload_lib.init_state(params, tx))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def place_train_state(params, tx, shardings: TrainState) -> TrainState:
    """A fresh state on master `params`, placed in `shardings` (`train_state_shardings`);
    offloaded, leaf by leaf, so the device never holds the whole optimizer state."""
    if offload_lib.is_offload(tx):
        return TrainState(jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
                          *offload_lib.place_state(params, tx, shardings.params,
                                                   shardings.opt_state))
    return jax.device_put(init_train_state(params, tx), shardings)


def masters(state: TrainState):
    """The master weights of a state: its params, or offloaded its host copy's."""
    if isinstance(state.opt_state, offload_lib.OffloadState):
        return state.opt_state.masters
    return state.params


def train_state_shardings(model_cfg, tx, mesh) -> TrainState:
    """Shardings of the train state, from shapes alone: optimizer leaves shaped like the
    parameters follow the parameters' sharding, the rest (counts, hyper-parameters) are
    replicated."""
    shapes = models.abstract_params(model_cfg)
    return state_shardings(tx, models.param_shardings(model_cfg, mesh, shapes), mesh, shapes)


def state_shardings(tx, param_sh, mesh, shapes) -> TrainState:
    """`train_state_shardings` of any parameter tree: its shapes and shardings given."""
    if offload_lib.is_offload(tx):
        return TrainState(mesh_lib.replicated(mesh), *offload_lib.state_shardings(
            tx, param_sh, mesh_lib.replicated(mesh), shapes))
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
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32),
                          offload_lib.abstract_params(tx, shapes)
                          if offload_lib.is_offload(tx) else shapes,
                          jax.eval_shape(tx.init, shapes))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        abstract, train_state_shardings(model_cfg, tx, mesh))


def make_init_fn(model_cfg, tx, mesh=None):
    """rng -> TrainState, every array created directly in its sharding."""
    def init(rng):   # (offloaded: the masters made on the device, then moved to the host)
        return init_train_state(models.init_params(model_cfg, rng), tx)
    if mesh is None:
        return jax.jit(init)
    return jax.jit(init, out_shardings=train_state_shardings(model_cfg, tx, mesh))


def jit_step(step, model_cfg, tx, mesh=None, *, uninit_scan: Optional[bool] = None):
    """`step(state, batch, *extra) -> (state, metrics)` jitted once with the state donated;
    with a mesh the state keeps its sharding, metrics are replicated and the batch keeps the
    sharding it is placed in (`lrl.mesh.put_batch`). `uninit_scan` lowers it with the layer
    scan's stacked outputs (saved residuals, weight gradients) uninitialised, not zero-filled
    (`lrl.models.scan_buffers`). None: on one device only, where it measured faster; on two
    GPUs with ring attention it was no faster and took more memory (docs/benchmark-history.md,
    "Uninitialised scan buffers, fifth session")."""
    if uninit_scan is None:
        uninit_scan = mesh is None or mesh.size == 1
    if mesh is None:
        jitted = jax.jit(step, donate_argnums=(0,))
    else:
        state_sh = train_state_shardings(model_cfg, tx, mesh)
        jitted = jax.jit(step, out_shardings=(state_sh, mesh_lib.replicated(mesh)),
                         donate_argnums=(0,))
    return UninitialisedScanJit(jitted) if uninit_scan else jitted
