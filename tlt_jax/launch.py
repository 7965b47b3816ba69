"""What every absl launcher shares: multi-host flags, run directories, flag parsing, console
output, input errors and the compilation cache.

Each launcher does `from tlt_jax import launch` (which defines the flags), calls
`launch.maybe_initialize_distributed()` first thing in `main`, and runs with
`launch.run(main)`. Multi-host runs go through `jax.distributed.initialize`; we add no
transport of our own.

- Console: progress bars, the few lines a person reads (`metrics.report`) and the result.
  Library logs (absl, jax, orbax) show from WARNING up; `--verbosity=0` adds their INFO
  lines, `--verbosity=1` their debug lines and full tracebacks.
- Bad input: a flag or config value refused before the run directory is prepared (a
  ValueError or FileNotFoundError naming the field) is one line on stderr and exit
  status 1; the run directory of an earlier run is left as it was.
- Compilation cache: JAX's persistent compilation cache in `--compilation_cache_dir`, so
  running a config again loads its compiled programs instead of compiling them;
  `--nocompilation_cache` turns it off.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading

import jax
from absl import app, flags, logging

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for multi-host runs (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Total number of processes (hosts).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
_COORDINATOR_TIMEOUT = flags.DEFINE_integer(
    "coordinator_timeout", 300, "Seconds every process waits for all --num_processes to join at "
    "--coordinator_address before it stops with an error.")
_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache", True, "Keep compiled programs in --compilation_cache_dir, so a rerun of a config skips "
    "its compiles (--nocompilation_cache: off).")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    os.environ.get("JAX_COMPILATION_CACHE_DIR")
    or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tlt_jax", "jax"),
    "Directory of JAX's persistent compilation cache (entries are keyed by program, jax version and backend).")

# The last phase whose input errors are shown as one line: until a launcher prepares its
# run directory, a ValueError or FileNotFoundError is bad input, afterwards a failure of
# the run (shown with its traceback).
_checking_input = True


def maybe_initialize_distributed() -> None:
    """Calls jax.distributed.initialize when multi-host flags are given. Bad flags are a
    flags.ValidationError naming the flag; processes that do not all join within
    --coordinator_timeout end this one with a one-line error (exit status 1)."""
    given = [f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)]
    if not any(given):
        return
    if not all(given):
        raise flags.ValidationError(
            "Multi-host runs need all of --coordinator_address, --num_processes and --process_id.")
    address, n, i = _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    if n < 1:
        raise flags.ValidationError(f"--num_processes={n} must be at least 1.")
    if not 0 <= i < n:
        raise flags.ValidationError(f"--process_id={i} is outside [0, --num_processes={n}).")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise flags.ValidationError(f"--coordinator_address={address} must be HOST:PORT (process 0's host).")
    if _COORDINATOR_TIMEOUT.value < 1:
        raise flags.ValidationError(f"--coordinator_timeout={_COORDINATOR_TIMEOUT.value} must be at least 1 s.")
    joined = threading.Event()
    threading.Thread(target=_fail_unless_joined, args=(joined, host, int(port)), daemon=True).start()
    # jax's own timeout, a little later than ours, ends the process with a fatal log of
    # its internals; ours says which flags to check.
    jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=i,
                               initialization_timeout=_COORDINATOR_TIMEOUT.value + 30)
    joined.set()
    logging.info("process %d of %d, %d local / %d global devices", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())


def _fail_unless_joined(joined: threading.Event, host: str, port: int) -> None:
    """Ends the process with a one-line error unless `joined` is set within
    --coordinator_timeout (jax.distributed.initialize blocks until every process joins)."""
    timeout = _COORDINATOR_TIMEOUT.value
    if joined.wait(timeout):
        return
    address, n = _COORDINATOR.value, _NUM_PROCESSES.value
    try:
        socket.create_connection((host, port), timeout=5).close()
        what = f"the coordinator at --coordinator_address={address} answered, but not all --num_processes={n} joined"
    except OSError:
        what = f"no coordinator answered at --coordinator_address={address}"
    sys.stderr.write(f"Error: {what} within --coordinator_timeout={timeout} s; start every process with the same "
                     "--coordinator_address (process 0's host) and --num_processes, each with its own --process_id.\n")
    sys.stderr.flush()
    os._exit(1)  # the main thread is blocked inside jax.distributed.initialize


def prepare_run_dir(run_dir: str, config) -> str:
    """Creates the run directory and records the resolved config in it (process 0).
    Validate the config first: this overwrites the config.json of an earlier run."""
    global _checking_input
    _checking_input = False
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_index() == 0:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config.to_dict(), f, indent=2, sort_keys=True, default=str)
    return run_dir


def check_checkpoint_dir(path: str, flag: str) -> None:
    """Raises FileNotFoundError naming `flag` unless `path` is a Hugging Face checkpoint
    directory (one with a config.json)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "does not exist" if not os.path.exists(path) else "has no config.json"
        raise FileNotFoundError(f"{flag}={path!r} {what}; pass a Hugging Face checkpoint directory (config.json and "
                                "*.safetensors, as transformers' save_pretrained writes).")


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


def enable_compilation_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache in `directory`, for every compile: most
    of the small models' compiles take under jax's default threshold of one second, and
    together they are most of a short job's start-up."""
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _configure_console() -> None:
    """Library logs from WARNING up unless --verbosity was given (absl's default is INFO:
    orbax alone logs ~40 lines per checkpoint save)."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


VERBOSITY_HELP = """
  --verbosity=0         library INFO logs too; --verbosity=1 debug logs and tracebacks
                        (default: progress bars, a few lines, the result; warnings)"""
_SHARED_HELP = VERBOSITY_HELP + """
  --nocompilation_cache, --compilation_cache_dir=DIR   JAX's persistent compilation
                        cache (default on, in $JAX_COMPILATION_CACHE_DIR or ~/.cache/tlt_jax/jax)
  --coordinator_address=HOST:PORT --num_processes=N --process_id=I   several hosts"""


def run(main, shared_help: str = _SHARED_HELP) -> None:
    """`absl.app.run` with the launcher's flag parsing, console, input errors and
    compilation cache (see the module docstring). --help shows the launcher's docstring,
    `shared_help` (the shared flags it takes) and its own flags; --helpfull every flag."""

    def launcher_main(argv):
        _configure_console()
        if _COMPILATION_CACHE.value:
            enable_compilation_cache(_COMPILATION_CACHE_DIR.value)
        try:
            return main(argv)
        except (ValueError, FileNotFoundError, flags.ValidationError) as e:
            if not _checking_input or logging.get_verbosity() >= logging.DEBUG:
                raise
            message = " ".join(str(e).split())
            sys.stderr.write(f"Error: {message}\n(--verbosity=1 shows the traceback)\n")
            sys.exit(1)

    launcher = sys.modules["__main__"]
    launcher.__doc__ = (launcher.__doc__ or "").rstrip() + "\n\nShared flags:" + shared_help + "\n"
    app.run(launcher_main, flags_parser=_parse_flags)
