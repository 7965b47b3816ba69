"""Device mesh with axes (data, fsdp, tensor) and logical-axis partitioning.

Every array kind names its dimensions with logical axes ("batch", "embed", "heads",
...); `LOGICAL_AXIS_RULES` maps those to mesh axes. A mesh axis is used only where it
divides the dimension (a 2-KV-head model on tensor=4 keeps its KV heads replicated),
and never twice in one spec. Steps are jitted with explicit in/out shardings
(`jit_sharded`), today's pjit.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes it may be split over, in priority order.
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": (),
    "head_dim": (),
    "length": (),
}


def mesh_shape_from_config(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Resolves {"data": d, "fsdp": f, "tensor": t} with at most one -1 ("the rest")."""
    unknown = sorted(set(mesh_config) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"Unknown mesh axes {unknown}; the mesh axes are {MESH_AXES}.")
    sizes = [int(mesh_config.get(axis, 1)) for axis in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"At most one mesh axis may be -1 (inferred); got {dict(zip(MESH_AXES, sizes))}.")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise ValueError(f"Mesh {dict(zip(MESH_AXES, sizes))} cannot fill {num_devices} devices: "
                             f"{num_devices} is not a multiple of {known}.")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"Mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but {num_devices} are "
            "available; make data*fsdp*tensor equal the device count, or set one axis to -1.")
    return tuple(sizes)


def make_mesh(mesh_config: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices) if devices is not None else jax.devices()
    shape = mesh_shape_from_config(mesh_config, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...]] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dimensions are `logical_axes`."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"Logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}.")
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape):
        if name is not None and name not in rules:
            raise ValueError(f"No sharding rule for logical axis {name!r}; known: {sorted(rules)}.")
        chosen = []
        for axis in rules.get(name, ()) if name else ():
            n = mesh.shape[axis]
            if axis in used or n == 1 or size % (math.prod(mesh.shape[a] for a in chosen) * n):
                continue
            chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def tree_shardings(logical_tree: Any, shape_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given its logical axes."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh)),
        logical_tree, shape_tree, is_leaf=_is_axis_names)


def _is_axis_names(node) -> bool:
    return isinstance(node, tuple) and all(name is None or isinstance(name, str) for name in node)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading axis over (data, fsdp), the rest replicated: how token batches travel."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def to_host(x) -> np.ndarray:
    """A host copy of a whole array, gathered from every process when it spans hosts."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def jit_sharded(fn: Callable, *, in_shardings, out_shardings, static_argnums=(), donate_argnums=()):
    """`jax.jit` with explicit shardings on every input and output (today's pjit)."""
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                   static_argnums=static_argnums, donate_argnums=donate_argnums)
