"""What a checkpoint step holds besides its arrays, and how its arrays are checked: the JSON
items (model config, experiment config, data-iterator state with bytes kept as base64), leaf
paths, typed PRNG keys as raw key data, order-independent checksums, and abstract target
states. Pure functions: `lrl.checkpoint` does the reading and writing."""
from __future__ import annotations

import base64
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lrl.models.config import ModelConfig

_BYTES = "__lrl_bytes_b64__"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a checkpoint that does not match what is asked of it."""


class StateMismatchError(CheckpointError):
    """The state asked for has another structure or shapes than the one saved: a caller
    error (wrong model or optimizer config), not a damaged checkpoint."""


# ----------------------------------------------------------------------------- JSON items

def model_config_to_dict(cfg: ModelConfig) -> dict:
    """ModelConfig -> JSON: dtypes by name, tuples as lists, nested dataclasses as dicts."""
    def plain(v):
        if isinstance(v, (type, np.dtype)):
            return jnp.dtype(v).name
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v
    return plain(cfg)


def model_config_from_dict(d: dict) -> ModelConfig:
    """The inverse of `model_config_to_dict`, typed by each field's default."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise CheckpointError(f"model_config has fields {unknown} that this lrl's ModelConfig "
                              "does not know (saved by a newer lrl?)")
    out = {}
    for k, v in d.items():
        default = fields[k].default
        if isinstance(default, (type, np.dtype)) and isinstance(v, str):
            v = getattr(jnp, v)
        elif dataclasses.is_dataclass(default) and isinstance(v, dict):
            v = type(default)(**v)
        elif isinstance(v, list):
            v = tuple(v)
        out[k] = v
    return ModelConfig(**out)


def jsonable(x):
    """Experiment configs (ConfigDict or dict) -> plain JSON; non-JSON values become strings."""
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def encode_data(x, where="data_state"):
    """JSON for the data-iterator state; bytes (grain's DataLoader states) anywhere inside
    are kept as base64 and come back as bytes."""
    if isinstance(x, bytes):
        return {_BYTES: base64.b64encode(x).decode("ascii")}
    if isinstance(x, dict):
        return {str(k): encode_data(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode_data(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"{where} is a {type(x).__name__}: the data state must be JSON "
                    "(dicts, lists, numbers, strings) or bytes")


def decode_data(x):
    if isinstance(x, dict):
        if set(x) == {_BYTES}:
            return base64.b64decode(x[_BYTES])
        return {k: decode_data(v) for k, v in x.items()}
    return [decode_data(v) for v in x] if isinstance(x, list) else x


# ----------------------------------------------------------------------------- state trees

def path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def weights_only(state):
    """A train state as `checkpoint.contents="weights"` saves it: its update count and its
    master weights in `params` (offloaded, those are the host copy, `OffloadState.masters`;
    the device's compute copy is cast from them), no optimizer state (moments, the schedule's
    count); any other tree as it is."""
    if "opt_state" not in getattr(state, "_fields", ()):
        return state
    masters = getattr(state.opt_state, "masters", None)
    return state._replace(params=state.params if masters is None else masters, opt_state=None)


def unwrap_keys(state):
    """Typed PRNG keys -> raw key data, and {leaf path: impl name} to wrap them back."""
    impls = {}

    def one(path, x):
        if is_key(x):
            impls[path_str(path)] = str(jax.random.key_impl(x))
            return jax.random.key_data(x)
        return x
    return jax.tree_util.tree_map_with_path(one, state), impls


def _bits_u32(x):
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _leaf_checksum(x):
    """Two uint32 sums of the raw bits, plain and position-weighted: modular integer sums do
    not depend on the order of reduction, so any sharding of the same values agrees."""
    bits = _bits_u32(x)
    idx = jnp.zeros(bits.shape, jnp.uint32)
    for d in range(bits.ndim):
        idx = idx * jnp.uint32(bits.shape[d]) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d)
    weights = idx * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


_tree_checksums = jax.jit(lambda leaves: [_leaf_checksum(x) for x in leaves])
# A leaf in host memory (an offloaded optimizer's, `lrl.rl.offload`) is summed on the device,
# one at a time: all of them at once would bring the whole offloaded state back.
_host_checksum = jax.jit(lambda x: _leaf_checksum(jax.device_put(x, jax.memory.Space.Device)))


def _on_host(x) -> bool:
    return getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"


def checksums(tree) -> dict[str, list[int]]:
    """{leaf path: [sum, weighted sum]} of a tree of arrays (keys as raw key data)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    host = {i: jax.device_get(_host_checksum(x)) for i, (_, x) in enumerate(flat) if _on_host(x)}
    rest = jax.device_get(_tree_checksums([jnp.asarray(x) for i, (_, x) in enumerate(flat)
                                           if i not in host]))[::-1]
    sums = [host[i] if i in host else rest.pop() for i in range(len(flat))]
    return {path_str(p): [int(v) for v in np.asarray(c)] for (p, _), c in zip(flat, sums)}


def abstract_state(state, shardings=None):
    """ShapeDtypeStructs with target shardings for `state` (arrays or ShapeDtypeStructs).

    `shardings`: None (use each leaf's own `.sharding`), one `Sharding` for every leaf, or a
    tree of shardings matching `state`.
    """
    if shardings is None:
        shard_tree = jax.tree.map(lambda x: getattr(x, "sharding", None), state)
    elif isinstance(shardings, jax.sharding.Sharding):
        shard_tree = jax.tree.map(lambda _: shardings, state)
    else:
        shard_tree = shardings

    def one(path, x, s):
        if s is None:
            raise ValueError(f"state leaf {path_str(path)!r} has no target sharding; pass "
                             "`shardings` or ShapeDtypeStructs with sharding=")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return jax.tree_util.tree_map_with_path(one, state, shard_tree,
                                            is_leaf=lambda x: x is None)
