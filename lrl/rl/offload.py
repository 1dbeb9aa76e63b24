"""Optimizer host offload: the fp32 master weights and the Adam moments live in pinned host
memory; the device holds the parameters in the compute dtype (bf16) and, while the optimizer
step runs, one layer's masters and moments at a time (verl's optimizer offload, in one XLA
program).

A 7B model's masters and moments are 12 bytes a parameter, 91 GB: with the fp32 gradient
accumulator (4 more) they do not fit one 141 GB H200 beside the update's activations and the
rollout's pool. Offloaded, the device keeps 2 + 4 bytes a parameter (bf16 weights, fp32
gradients) and streams the rest.

The train state keeps its shape, `TrainState(step, params, opt_state)`: `params` are the
compute-dtype weights every forward reads (update, log-probs, rollout), `opt_state` an
`OffloadState(masters, inner)` in host memory. The optimizer step (`finish`, in place of
`optax` on the whole tree) is

  1. the global norm over all gradients, on the device (the only cross-parameter step), for
     the clip, applied to each block as it is updated;
  2. the element-wise rest (AdamW with its schedule, `inner`) once on the parameters outside
     the scanned layers (with `split_rest`, those larger than a layer, 7B's embeddings and
     head, a block of rows at a time in a `fori_loop`), then in a `fori_loop` over the
     layers: layer l's masters and moments are moved to the device, updated, moved back into
     their host buffers in place, and its new weights cast into the compute-dtype parameters.
     So the device holds the masters and moments of no more than a layer at a time.

The element-wise optimizer is called on a tree of the parameters' own structure in which
the leaves outside the current block are empty arrays, so masks that read parameter paths
(no weight decay on norms and biases) see the tree they were written for. It is the same
arithmetic as the on-device update (tests/test_offload.py compares them).

`decide` is the `optim.offload="auto"` rule. L layers.
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lrl import xla_env

log = logging.getLogger(__name__)

CHOICES = ("auto", "on", "off")
HOST = "pinned_host"
LAYERS = "layers"   # the params key of the scanned layers (leading L axis)
# "auto" offloads when the on-device train state (masters, two moments, the gradient
# accumulator) would take more than this share of what the device may allocate: the rest is
# the update's activations and log-prob chunks, the rollout's KV pool and the decode weights
# (the default pool alone takes 0.4 of what is free).
STATE_SHARE = 0.5
# ... and only when the host holds the offloaded state with this share of its memory to spare
# for everything else the process keeps (data, rewards, checkpoints being written).
HOST_SHARE = 0.85


class Offload(NamedTuple):
    """The offloaded optimizer: what `lrl.rl.train` builds the state and the step from."""
    inner: optax.GradientTransformation   # element-wise: AdamW with its schedule, no clip
    clip_norm: Optional[float]            # global-norm clip before it (None / 0: none)
    compute_dtype: Any                    # the device copy's dtype (model.dtype)
    master_dtype: Any = jnp.float32
    # Parameters outside the layers larger than a layer updated a block of rows at a time
    # (`finish`). Only where they are not sharded (one device): a block of rows of a sharded
    # array would be gathered.
    split_rest: bool = False

    def init(self, params):
        """The optimizer state of `params` (the masters): as `optax`'s `init`, so code that
        only reads shapes (`jax.eval_shape(tx.init, ...)`) works unchanged."""
        return OffloadState(params, self.inner.init(params))


class OffloadState(NamedTuple):
    masters: Any   # the master weights, master_dtype, in host memory
    inner: Any     # `Offload.inner`'s state: moments in host memory, counts on the device


def is_offload(tx) -> bool:
    return isinstance(tx, Offload)


# --- The auto rule ------------------------------------------------------------------------

def state_bytes(shapes, shardings=None, bytes_per_param: int = 16) -> int:
    """Bytes of a training state of `bytes_per_param` per parameter on one device: fp32
    masters, two moments and the gradient accumulator are 16; `shardings` (param
    shardings) divide each leaf by its shards."""
    total = 0
    leaves = jax.tree.leaves(shapes)
    shs = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
    for x, sh in zip(leaves, shs):
        n = int(np.prod(sh.shard_shape(x.shape))) if sh is not None else int(np.prod(x.shape))
        total += n * bytes_per_param
    return total


def decide(mode: str, *, platform: str, device_limit: Optional[int], on_device: int,
           offloaded_host: int, host_limit: Optional[int],
           pinned_limit: Optional[int] = None) -> tuple[bool, str]:
    """-> (offload?, why), the `optim.offload` rule. `on_device`: bytes one device would hold
    for masters, moments and gradients without offload; `offloaded_host`: bytes this host
    would hold with it (masters and moments of its devices); `device_limit`, `host_limit`: what
    each may allocate (None: unknown). "auto" offloads when the state would take more than
    STATE_SHARE of the device and the host holds it within HOST_SHARE of its memory; never on
    a CPU-only platform, whose "host" is its device. "on" / "off" force it ("on" still fails
    loudly when the host cannot hold the state). `pinned_limit`: what jax's GPU client may
    pin (`lrl.xla_env.pinned_limit`; None: no cap), which the state must fit too."""
    if mode not in CHOICES:
        raise ValueError(f"optim.offload={mode!r}; choose one of {CHOICES}")
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    host_ok = host_limit is None or offloaded_host <= HOST_SHARE * host_limit
    pinned_ok = pinned_limit is None or offloaded_host <= pinned_limit
    raise_cap = (f"raise XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (it lets jax pin "
                 f"{gib(pinned_limit or 0)}) before the run starts")
    if mode == "off":
        return False, "optim.offload='off'"
    if mode == "on":
        if not host_ok:
            raise ValueError(
                f"optim.offload='on': the masters and moments ({gib(offloaded_host)}) do not "
                f"fit this host's memory ({gib(host_limit)}, {HOST_SHARE:.0%} usable); shard "
                "them over more devices (mesh.fsdp) or hosts, or use model.param_dtype="
                "'bfloat16'")
        if not pinned_ok:
            raise ValueError(
                f"optim.offload='on': the masters and moments ({gib(offloaded_host)}) do not "
                f"fit the pinned host memory jax may allocate: {raise_cap}")
        return True, "optim.offload='on'"
    if platform == "cpu":
        return False, "auto: a CPU platform's host memory is its device memory"
    if device_limit is None:
        return False, "auto: the device does not report its memory"
    if on_device <= STATE_SHARE * device_limit:
        return False, (f"auto: masters, moments and gradients ({gib(on_device)}) fit in "
                       f"{STATE_SHARE:.0%} of the device's {gib(device_limit)}")
    if not host_ok:
        log.warning("optim.offload='auto': the device cannot hold the optimizer state "
                    "(%s of %s) and the host cannot either (%s of %s): left on the device",
                    gib(on_device), gib(device_limit), gib(offloaded_host), gib(host_limit))
        return False, "auto: the host cannot hold the optimizer state either"
    if not pinned_ok:
        log.warning("optim.offload='auto': the device cannot hold the optimizer state "
                    "(%s of %s) and jax may pin only %s of host memory for its %s: left on the "
                    "device; %s", gib(on_device), gib(device_limit), gib(pinned_limit),
                    gib(offloaded_host), raise_cap)
        return False, "auto: jax may not pin enough host memory for the optimizer state"
    return True, (f"auto: masters, moments and gradients ({gib(on_device)}) exceed "
                  f"{STATE_SHARE:.0%} of the device's {gib(device_limit)}: masters and moments "
                  f"({gib(offloaded_host)}) in host memory")


def decide_for(mode: str, model_cfg, mesh) -> tuple[bool, str]:
    """`decide` for a model config on a mesh, with this process's devices and host."""
    from lrl import models
    from lrl.rl import budget as budget_lib
    if mode == "off":
        return False, "optim.offload='off'"
    shapes = models.abstract_params(model_cfg)
    sh = models.param_shardings(model_cfg, mesh, shapes) if mesh is not None else None
    device = jax.local_devices()[0]
    memory = budget_lib.device_memory(device)
    local = len(jax.local_devices()) if mesh is None else sum(
        d.process_index == jax.process_index() for d in mesh.devices.flat)
    master = jnp.dtype(model_cfg.param_dtype).itemsize
    return decide(mode, platform=device.platform, device_limit=memory and memory[0],
                  on_device=state_bytes(shapes, sh, 4 * master),
                  offloaded_host=local * state_bytes(shapes, sh, 3 * master),
                  host_limit=xla_env.host_memory(),
                  pinned_limit=xla_env.pinned_limit() if device.platform == "gpu" else None)


# --- The state, its shardings ---------------------------------------------------------------

def host_sharding(sh):
    return sh.with_memory_kind(HOST)


def init_state(params, tx: Offload):
    """(compute-dtype params, OffloadState) from master `params`; placed by the caller."""
    params = jax.tree.map(lambda x: jnp.asarray(x, tx.master_dtype), params)
    return jax.tree.map(lambda x: x.astype(tx.compute_dtype), params), tx.init(params)


def place_state(params, tx: Offload, params_sh, opt_sh):
    """(compute params, OffloadState) of master `params`, placed in `params_sh` / `opt_sh`
    (`state_shardings`) one leaf at a time: built whole on the device (as `init_state` then
    a `device_put`) a 7B state would take 106 GB of it before moving out. The moments start
    as zeros made on the host; the optimizer's scalar state comes from `inner.init` on empty
    parameters (it does not depend on their values)."""
    params = jax.tree.map(_off_host, params)   # masters handed on from an offloaded phase
    compute = jax.tree.map(lambda x, sh: jax.device_put(x.astype(tx.compute_dtype), sh),
                           params, params_sh)
    masters = jax.tree.map(lambda x, sh: jax.device_put(x.astype(tx.master_dtype), sh),
                           params, opt_sh.masters)
    small = tx.inner.init(jax.tree.map(lambda x: jnp.zeros((0,), tx.master_dtype), params))
    inner = optax.tree_utils.tree_map_params(
        tx.inner, lambda leaf, x: np.zeros(x.shape, leaf.dtype), small, params,
        transform_non_params=lambda leaf: leaf)
    inner = jax.tree.map(jax.device_put, inner, opt_sh.inner)
    return compute, OffloadState(masters, inner)


def _off_host(x):
    sh = getattr(x, "sharding", None)
    if getattr(sh, "memory_kind", None) == HOST:
        return jax.device_put(x, sh.with_memory_kind("device"))
    return x


def state_shardings(tx: Offload, param_sh, replicated, shapes):
    """(params', opt_state's) shardings: the compute params like `param_sh`; masters and
    moments like them, in host memory; the optimizer's counts and hyper-parameters
    `replicated` on the devices."""
    host = jax.tree.map(host_sharding, param_sh)
    inner = optax.tree_utils.tree_map_params(
        tx.inner, lambda _, sh: sh, jax.eval_shape(tx.inner.init, shapes), host,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return param_sh, OffloadState(host, inner)


def abstract_params(tx: Offload, shapes):
    """The compute params' shapes from the masters'."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, tx.compute_dtype), shapes)


# --- The streamed optimizer step ----------------------------------------------------------

def _in_layers(path) -> bool:
    return bool(path) and getattr(path[0], "key", None) == LAYERS


def _kinds(tx: Offload, params):
    """Flat lists: each parameter leaf's block, "L" (in the scanned layers), "B" (outside
    them, larger than a layer: updated a block of rows at a time, when `tx.split_rest`) or
    "R" (the rest, together); each optimizer-state leaf's parameter (its index in the flat
    parameters, -1 for scalar state: step counts, the injected learning rate)."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    leaves = jax.tree.leaves(params)
    layer = sum(x.size // x.shape[0] for path, x in zip(paths, leaves) if _in_layers(path))
    kinds = ["L" if _in_layers(path) else
             "B" if tx.split_rest and layer and x.ndim and x.size > layer else "R"
             for path, x in zip(paths, leaves)]
    index = jax.tree.unflatten(jax.tree.structure(params), list(range(len(leaves))))
    shapes = jax.eval_shape(tx.inner.init, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, tx.master_dtype), params))
    owner = optax.tree_utils.tree_map_params(
        tx.inner, lambda _, i: i, shapes, index, transform_non_params=lambda _: -1,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return kinds, jax.tree.leaves(owner), layer


def _rows_per_block(x, most: int) -> int:
    """The most rows of `x` (a divisor of its first dimension) whose elements are at most
    `most`; one row if a row alone is more."""
    n, row = x.shape[0], x.size // x.shape[0]
    return max([d for d in range(1, n + 1) if n % d == 0 and d * row <= most] or [1])


def _empty(x):
    return jnp.zeros((0,), x.dtype)


def _block(tx: Offload, treedef, sdef, g, m, s):
    """The element-wise optimizer on one block: flat lists of gradients, masters and state
    leaves where those outside the block are empty -> (new masters, new state, sum of the
    updates' squares), as flat lists."""
    updates, s_new = tx.inner.update(jax.tree.unflatten(treedef, g),
                                     jax.tree.unflatten(sdef, s),
                                     jax.tree.unflatten(treedef, m))
    m_new = optax.apply_updates(jax.tree.unflatten(treedef, m), updates)
    sq = sum(jnp.sum(jnp.square(u.astype(jnp.float32))) for u in jax.tree.leaves(updates))
    return jax.tree.leaves(m_new), jax.tree.leaves(s_new), sq


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def _clip_fn(g_norm, max_norm):
    """`optax.clip_by_global_norm(max_norm)` as a function of one gradient block, the norm
    taken over all of them: applied block by block, so no clipped copy of every gradient
    (7B: 30 GB) exists at once. The same operations as optax's, so the same numbers."""
    if not max_norm:
        return lambda t: t
    trigger = jnp.squeeze(g_norm < max_norm)
    return lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)


def finish(state, grads, tx: Offload):
    """The optimizer step of an offloaded state on gradients `grads` (on the device) ->
    (params, opt_state, grads' global norm, updates' global norm)."""
    grads = jax.tree.map(lambda g: g.astype(tx.master_dtype), grads)
    grad_norm = optax.global_norm(grads)
    clip = _clip_fn(grad_norm, tx.clip_norm)
    masters, inner = state.opt_state
    kinds, owner, layer = _kinds(tx, state.params)
    treedef, sdef = jax.tree.structure(state.params), jax.tree.structure(inner)
    g, m, p = (jax.tree.leaves(t) for t in (grads, masters, state.params))
    s = jax.tree.leaves(inner)

    def step(select, slice_, put_device, put_host, m, s_cur, p, sq):
        """The element-wise optimizer on the leaves `select(i)` picks, each cut by `slice_`
        -> the masters, state and compute params with the block written back, sq added."""
        m_i, s_i, sq_i = _block(
            tx, treedef, sdef,
            [clip(slice_(x)) if select(i) else _empty(x) for i, x in enumerate(g)],
            [_to_device(slice_(x)) if select(i) else _empty(x) for i, x in enumerate(m)],
            # scalar state: the step's own, whatever block (the counts advance once)
            [x if o < 0 else _to_device(slice_(y)) if select(o) else _empty(y)
             for x, y, o in zip(s, s_cur, owner)])
        m = [put_host(x, y) if select(i) else x for i, (x, y) in enumerate(zip(m, m_i))]
        s_new = [y if o < 0 else put_host(x, y) if select(o) else x
                 for x, y, o in zip(s_cur, s_i, owner)]
        p = [put_device(x, y.astype(x.dtype)) if select(i) else x
             for i, (x, y) in enumerate(zip(p, m_i))]
        return m, s_new, p, sq + sq_i

    # The parameters outside the layers (embeddings, final norm, head), in one block; its
    # state's scalars (step counts, the injected learning rate) are the step's.
    whole = lambda x: x  # noqa: E731
    m, s_out, p, sq = step(lambda i: kinds[i] == "R", whole, lambda _, y: y,
                           lambda _, y: _to_host(y), m, s, p, jnp.zeros((), jnp.float32))

    # Those larger than a layer (7B's embeddings and head: 1.09B parameters, 13 GB of masters
    # and moments at once), a block of rows at a time, so the device never holds more of
    # them than of a layer.
    for j in (i for i, k in enumerate(kinds) if k == "B"):
        rows = _rows_per_block(g[j], layer)

        def row_block(r, carry, j=j, rows=rows):
            cut = lambda x: jax.lax.dynamic_slice_in_dim(x, r * rows, rows, 0)  # noqa: E731
            put = lambda buf, y: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                buf, y, r * rows, 0)
            return step(lambda i: i == j, cut, put, lambda buf, y: put(buf, _to_host(y)),
                        *carry)

        m, s_out, p, sq = jax.lax.fori_loop(0, g[j].shape[0] // rows, row_block,
                                            (m, s_out, p, sq))

    n_layers = next((x.shape[0] for x, k in zip(g, kinds) if k == "L"), 0)

    def layer_step(i, carry):
        take = lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # noqa: E731
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0)  # noqa: E731
        return step(lambda k: kinds[k] == "L", take, put, lambda buf, y: put(buf, _to_host(y)),
                    *carry)

    # The loop carries only the layers' buffers (each updated in place, one slice a layer).
    m, s_out, p, sq = jax.lax.fori_loop(0, n_layers, layer_step, (m, s_out, p, sq))
    return (jax.tree.unflatten(treedef, p),
            OffloadState(jax.tree.unflatten(treedef, m), jax.tree.unflatten(sdef, s_out)),
            grad_norm, jnp.sqrt(sq))
