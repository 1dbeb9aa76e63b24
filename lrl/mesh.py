"""The device mesh (the run's meshes from the options: `build_meshes`), parameter sharding
rules and activation shardings.

Every array in lrl is laid out over one `jax.sharding.Mesh` with the axes below. Parameters
are sharded by rules keyed on their logical axes (see `lrl.models.params.logical_axes`), and
a rule applies only where the mesh axis divides the dimension: shardings come from shapes.

Dimension letters: B batch · T positions · D model width · F MLP width · V vocabulary ·
N query heads · K kv heads · H head dim · L layers.
"""
from __future__ import annotations

import logging
import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lrl import distributed

AXES = ("data", "fsdp", "seq", "tensor")
# Axes over which the rows of a batch are split: plain data parallelism and FSDP both hold
# different rows; FSDP additionally shards the parameters.
BATCH_AXES = ("data", "fsdp")

# Logical parameter axis -> mesh axes it may be sharded over, in order of preference.
PARAM_RULES: Mapping[str, tuple[str, ...]] = {
    "layers": (),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "norm": (),
}


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolves the per-axis sizes; one axis may be -1, meaning "all remaining devices"."""
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axis {sorted(unknown)}; the axes are {AXES}")
    shape = [int(sizes.get(a, 1)) for a in AXES]
    free = [i for i, s in enumerate(shape) if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {dict(zip(AXES, shape))}")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh: axis sizes must be positive or -1, got {dict(zip(AXES, shape))}")
    known = math.prod(s for s in shape if s != -1)
    if free:
        if num_devices % known:
            raise ValueError(f"mesh: {num_devices} devices do not divide by {known} "
                             f"({dict(zip(AXES, shape))})")
        shape[free[0]] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh: {dict(zip(AXES, shape))} needs {math.prod(shape)} devices, "
                         f"{num_devices} are present")
    return tuple(shape)


def make_mesh(sizes: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ("data", "fsdp", "seq", "tensor"); missing axes have size 1."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(dict(sizes or {"fsdp": -1}), len(devices))
    # Auto axes: shardings are propagated by GSPMD; shard_map regions make them Manual.
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)


def split_devices(devices: Sequence[jax.Device], rollout: int) -> tuple[list, list]:
    """-> (training devices, rollout devices): the last `rollout` of `devices` sample, the
    others train (the one-step-off pipeline's two disjoint meshes, `lrl.pipeline`)."""
    devices = list(devices)
    if not 1 <= rollout < len(devices):
        raise ValueError(f"split_devices: {rollout} rollout devices of {len(devices)} leave "
                         "none to train, or take none")
    return devices[:-rollout], devices[-rollout:]


def reshape(mesh: Mesh, sizes: Mapping[str, int]) -> Mesh:
    """The same devices in the same order (so one program may read arrays of both meshes)
    under other axis sizes (one may be -1)."""
    devices = np.asarray(mesh.devices).reshape(-1)
    return Mesh(devices.reshape(mesh_shape(sizes, devices.size)), AXES,
                axis_types=(AxisType.Auto,) * len(AXES))


def maybe_initialize_distributed(cfg) -> None:
    """Starts jax.distributed when the config asks for it (multi-host runs).

    `cfg` is `config.distributed` (fields and defaults in `lrl.distributed.DEFAULTS`): empty
    address / count / id let JAX detect them (SLURM, Open MPI, cloud TPU); timeouts are
    bounded, CPU runs get gloo collectives, and a failing process exits without hanging.
    """
    distributed.initialize(cfg)


def build_mesh(opts) -> Mesh:
    """The mesh of `opts.mesh` (jax.distributed started first when `opts.distributed` asks)."""
    maybe_initialize_distributed(opts.distributed)
    mesh = make_mesh(opts.mesh.sizes())
    logging.info("mesh: %s", describe(mesh))
    return mesh


def build_meshes(opts) -> tuple[Mesh, Optional[Mesh]]:
    """-> (the training mesh, the rollout mesh or None). With `pipeline.rollout_devices` = n
    the last n devices form the rollout mesh (`tensor` = `pipeline.rollout_tensor`, or n) and
    the `mesh.*` sizes shape the others; errors name the options that do not fit."""
    n = opts.pipeline.rollout_devices
    if not n:
        return build_mesh(opts), None
    maybe_initialize_distributed(opts.distributed)
    devices = jax.devices()
    if jax.process_count() > 1:
        raise ValueError(f"pipeline.rollout_devices={n} runs in one process only, not "
                         f"{jax.process_count()}")
    if n >= len(devices):
        raise ValueError(f"pipeline.rollout_devices={n} of the {len(devices)} devices leaves "
                         "none to train: the pipeline needs at least 2 devices and one "
                         "training; leave it 0 to run rollout and update in turn")
    train, rollout = split_devices(devices, n)
    try:
        mesh = make_mesh(opts.mesh.sizes(), train)
    except ValueError as e:
        raise ValueError(f"{e} (pipeline.rollout_devices={n} leaves {len(train)} devices to "
                         "the mesh.* sizes)") from e
    tensor = opts.pipeline.rollout_tensor or n
    if len(train) % tensor:
        raise ValueError(f"pipeline.rollout_tensor={tensor} does not divide the {len(train)} "
                         "training devices (pipeline.rollout_devices="
                         f"{n}): the weights are gathered on them into the rollout's "
                         "tensor slices before the copy")
    rollout_mesh = make_mesh({"fsdp": -1, "tensor": tensor}, rollout)
    logging.info("mesh: train %s, rollout %s", describe(mesh), describe(rollout_mesh))
    return mesh, rollout_mesh


def data_shards(mesh: Mesh) -> int:
    """The data-parallel shards of `mesh`: the rows of a batch are split over data x fsdp."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def spec_for(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
             rules: Mapping[str, tuple[str, ...]] = PARAM_RULES) -> P:
    """PartitionSpec for one array from its logical axes; a mesh axis is used at most once
    and only where it divides the dimension (else that dimension stays replicated)."""
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        chosen = []
        for axis in rules.get(name, ()) if name else ():
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in chosen) * size) == 0:
                chosen.append(axis)
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*out)


def param_shardings(mesh: Mesh, shapes, axes,
                    rules: Mapping[str, tuple[str, ...]] = PARAM_RULES) -> object:
    """NamedShardings for a parameter tree, given its shapes and its logical-axes tree."""
    return jax.tree.map(
        lambda s, a: NamedSharding(mesh, spec_for(a, s.shape, mesh, rules)), shapes, axes,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, (str, type(None))) for e in x))


def batch_spec(mesh: Mesh, rank: int, seq: bool = True) -> P:
    """Rows over (data, fsdp), positions over seq (if asked), the rest replicated."""
    rows = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1) or None
    if rows is not None and len(rows) == 1:
        rows = rows[0]
    rest = [("seq" if seq and mesh.shape["seq"] > 1 else None)] if rank > 1 else []
    return P(rows, *rest, *([None] * (rank - 1 - len(rest))))


def batch_sharding(mesh: Mesh, rank: int = 2, seq: bool = True) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh, rank, seq))


def row_sharding(mesh: Mesh, x) -> NamedSharding:
    """The sharding of one batch array: [B, T] rows over (data, fsdp) and T over seq; [B, 3, T]
    (M-RoPE positions) the same with the 3 whole; other ranks rows-first, the rest whole."""
    if np.ndim(x) == 3:
        rows, seq = batch_spec(mesh, 2)
        return NamedSharding(mesh, P(rows, None, seq))
    return batch_sharding(mesh, np.ndim(x))


def put_batch(mesh: Optional[Mesh], arrays: Mapping[str, object]) -> dict:
    """Host arrays -> device arrays in `row_sharding`. With several processes each holds its
    own rows and the global batch is assembled from the local pieces."""
    if mesh is None:
        return {k: jax.device_put(np.asarray(v)) for k, v in arrays.items()}
    if jax.process_count() == 1:
        return {k: jax.device_put(np.asarray(v), row_sharding(mesh, v))
                for k, v in arrays.items()}
    return {k: jax.make_array_from_process_local_data(row_sharding(mesh, v), np.asarray(v))
            for k, v in arrays.items()}


def rows_divisible(mesh: Mesh, rows: int) -> None:
    n = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if rows % n:
        raise ValueError(f"batch of {rows} rows does not divide over data×fsdp = {n} devices")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(mesh: Mesh) -> str:
    return " ".join(f"{a}={mesh.shape[a]}" for a in AXES) + f" ({np.prod(list(mesh.shape.values()))} devices)"
