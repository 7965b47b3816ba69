"""Host data across the processes of a multi-host run (`jax.distributed`).

Every process runs the same program; device computations on a mesh that spans processes
are collective. What the host needs besides (rollout results, a tuner's state, drafter
weights the leader trained) travels through `jax.experimental.multihost_utils` collectives
and the coordination service's barrier. Process 0 is the leader: it writes metrics, plots
and exports, and trains the drafter. In a single process every function here is the
identity or returns at once.

Every function is collective: all processes call it, in the same order, from the thread
that runs the RL step.
"""
from __future__ import annotations

import collections
import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

_barriers: collections.Counter = collections.Counter()


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def wait_for_all(name: str, timeout_s: float = 3600.0) -> None:
    """A barrier on the host, through jax.distributed's coordination service: waiting
    here keeps this process's devices free (a device collective would occupy them until
    the slowest process joins, and stall the drafter steps the leader runs meanwhile)."""
    if not is_multiprocess():
        return
    _barriers[name] += 1
    try:
        from jax._src import distributed  # the client jax.distributed.initialize connected
        client = distributed.global_state.client
    except (ImportError, AttributeError):
        client = None
    if client is None:  # the device collective that follows waits instead
        return
    client.wait_at_barrier(f"tlt_jax/{name}/{_barriers[name]}", int(timeout_s * 1000))


def allgather_objects(obj: Any) -> list:
    """Every process's `obj` (picklable host data), in process order."""
    if not is_multiprocess():
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(row[:n].tobytes()) for row, n in zip(gathered, sizes)]


def broadcast_object(obj: Any) -> Any:
    """Process 0's `obj` (picklable host data) on every process."""
    if not is_multiprocess():
        return obj
    return allgather_objects(obj if is_leader() else None)[0]


def broadcast_arrays(tree: Any) -> Any:
    """Process 0's tree of host arrays on every process (every process passes a tree of
    the same structure, shapes and dtypes)."""
    if not is_multiprocess():
        return tree
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
