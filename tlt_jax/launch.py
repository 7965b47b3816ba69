"""What every absl launcher shares: multi-host flags, run directories, model presets.

Each launcher does `from tlt_jax import launch` (which defines the flags) and calls
`launch.maybe_initialize_distributed()` first thing in `main`. Multi-host runs go
through `jax.distributed.initialize`; we add no transport of our own.
"""
from __future__ import annotations

import json
import os
import sys

import jax
from absl import app, flags, logging

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for multi-host runs (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Total number of processes (hosts).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def maybe_initialize_distributed() -> None:
    """Calls jax.distributed.initialize when multi-host flags are given."""
    given = [f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)]
    if not any(given):
        return
    if not all(given):
        raise flags.ValidationError(
            "Multi-host runs need all of --coordinator_address, --num_processes and --process_id.")
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
    logging.info("process %d of %d, %d local / %d global devices", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())


def prepare_run_dir(run_dir: str, config) -> str:
    """Creates the run directory and records the resolved config in it (process 0)."""
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_index() == 0:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config.to_dict(), f, indent=2, sort_keys=True, default=str)
    return run_dir


def _parse_flags(argv):
    """absl's flag parsing, with config overrides of unknown keys reported as flag errors
    rather than as a traceback from inside ml_collections."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        message = str(e)
    except (AttributeError, KeyError) as e:
        detail = str(e.args[0] if e.args else e).replace("\\'", "'").replace("\\n", ";").replace("'", "")
        message = f"unknown config key {detail}"
    sys.stderr.write(f"FATAL Flags parsing error: {message}\nPass --helpfull to see the flags.\n")
    sys.exit(1)


def run(main) -> None:
    """`absl.app.run` with the launcher's flag parsing."""
    app.run(main, flags_parser=_parse_flags)
