"""One of two processes for tests/test_checkpoint.py: process 0 saves a checkpoint of its
own twice (`this_process_only`), then both save a shared one; prints every process's count of
orbax saves as JSON before and after the shared save, then "saved". Run as `python -m
tests.support.save_count_worker DIR HOST:PORT PROCESS_ID` from the repository root."""
import json
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from tlt_jax import checkpoint


def _print_counts() -> None:
    count = int(checkpoint._OrbaxSaveCount.get_current_operation_id())
    counts = multihost_utils.process_allgather(np.asarray([count], np.int32))
    print(json.dumps(np.asarray(counts).reshape(-1).tolist()), flush=True)


def main(directory: str, address: str, process_id: str) -> None:
    jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=int(process_id),
                               initialization_timeout=60)
    alone = (checkpoint.Checkpointer(f"{directory}/alone", this_process_only=True, async_save=False)
             if jax.process_index() == 0 else None)
    for step in (1, 2):
        if alone is not None:
            alone.save(step, {"x": np.arange(3)})
    _print_counts()
    shared = checkpoint.Checkpointer(f"{directory}/shared", async_save=False)
    shared.save(1, {"x": np.arange(3)})
    _print_counts()
    shared.close()
    if alone is not None:
        alone.close()
    print("saved", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
