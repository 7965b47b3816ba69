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
  ValueError or FileNotFoundError naming the field, an ImportError naming a missing
  extra) is one line on stderr and exit status 1; the run directory of an earlier run is left as it was.
- One run directory, one experiment: `prepare_run_dir` records a new run's config in
  config.json and checks a rerun against it. A change to a field that alters what is
  learned or how it is scored (every field but the launcher's `inert` ones) is refused
  unless `--config.resume_changes` names it; accepted changes are appended to
  config_history.jsonl with the step they hold from, and config.json keeps the first config.
- Pointers: `check_path` refuses a given path (a starting checkpoint, drafter, teacher,
  cache) that does not exist, naming its flag; "" is the field's documented default.
- Compilation cache: JAX's persistent compilation cache in `--compilation_cache_dir`, so
  running a config again loads its compiled programs instead of compiling them;
  `--nocompilation_cache` turns it off.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar, get_type_hints

import jax
from absl import app, flags, logging

from tlt_jax import multihost

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


CONFIG_FILENAME = "config.json"  # the run's first config
HISTORY_FILENAME = "config_history.jsonl"  # each accepted change of a resumed run, with its step
# Where the run is and which changes it accepts alter nothing it learns.
_ALWAYS_INERT = ("run_dir", "resume_changes")
_ABSENT = "<absent>"


def flat_config(config) -> dict:
    """{dotted field: value} of a ConfigDict or nested dict as config.json records it (JSON
    values: tuples as lists, other objects as their str); an empty section is one value, {}."""
    tree = json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else config, default=str))
    flat = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(f"{prefix}{key}.", value)
        else:
            flat[prefix[:-1]] = node

    walk("", tree)
    return flat


_D = TypeVar("_D")
ALL_OTHERS = "*"  # `config_dataclass(..., others=ALL_OTHERS)`: read only the keys of the dataclass's fields


def config_dataclass(cls: type[_D], section, where: str, *, others: Sequence[str] | str = (), **given: Any) -> _D:
    """A `cls` (a dataclass) from the config section `where` (its dotted name, "" for the
    root: errors name its fields), field by field name, so that a new field needs no
    copying code. Each key of `section` fills the field of its name; a nested section
    fills a field whose type is a dataclass the same way; `given` fills the fields the
    run computes and overrides the section's value of the same name; a field found in
    neither keeps its default. `others`: the section's keys that configure something else
    (skipped), or ALL_OTHERS for a section holding much else (the config's root): only the
    keys of `cls`'s fields are read. Raises ValueError naming an unknown key or a field
    without a default that nothing fills, the message starting with its dotted name."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(section.items()) if section is not None else {}
    prefix = f"{where}." if where else ""
    if others == ALL_OTHERS:
        values = {k: v for k, v in values.items() if k in fields}
    unknown = sorted(set(values) - set(fields) - set(others) - set(given))
    if unknown:
        raise ValueError(f"{', '.join(prefix + k for k in unknown)}: unknown config key; {where or 'the config'} "
                         f"takes {', '.join(sorted(fields))}.")
    hints = get_type_hints(cls)
    kwargs = {}
    for name, value in {**{k: v for k, v in values.items() if k in fields}, **given}.items():
        nested = hints.get(name)
        if dataclasses.is_dataclass(nested) and isinstance(nested, type) and _is_section(value):
            value = config_dataclass(nested, value, f"{prefix}{name}")
        kwargs[name] = value
    missing = [n for n, f in fields.items() if n not in kwargs and f.init
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{', '.join(prefix + n for n in missing)}: missing from the config; give "
                         f"{'them' if len(missing) > 1 else 'it'} a value.")
    return cls(**kwargs)


def _is_section(value) -> bool:
    return isinstance(value, Mapping) or hasattr(value, "to_dict")


def _under(field: str, names: Sequence[str]) -> bool:
    """Whether `field` is one of `names` or lies in a section among them."""
    return any(field == n or field.startswith(n + ".") for n in names)


def _show(change: dict) -> str:
    value = lambda key: json.dumps(change[key]) if key in change else _ABSENT
    return f"{change['field']}: {value('old')} -> {value('new')}"


def _recorded_config(run_dir: str) -> dict | None:
    """The flat config the run in run_dir runs with now: its first config with every
    accepted change applied; None when run_dir holds no run."""
    path = os.path.join(run_dir, CONFIG_FILENAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            flat = flat_config(json.load(f))
    except ValueError as e:
        raise ValueError(f"{path} is not the JSON config a run records ({e}); move it aside to start over "
                         "in --config.run_dir, or give a new --config.run_dir.") from e
    for entry in config_history(run_dir):
        for change in entry["changes"]:
            if "new" in change:
                flat[change["field"]] = change["new"]
            else:
                flat.pop(change["field"], None)
    return flat


def config_history(run_dir: str) -> list[dict]:
    """The entries of run_dir's config_history.jsonl, oldest first: {"step": the checkpoint
    step the run resumed from (the changes hold for the steps after it), "time",
    "changes": [{"field", "old", "new", "learned"}]}; "old" or "new" is left out for a
    field that was absent, "learned" is true for a change --config.resume_changes accepted."""
    path = os.path.join(run_dir, HISTORY_FILENAME)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _compare(run_dir: str, config, inert: Sequence[str]) -> list[dict]:
    """The changes of `config` from the run recorded in run_dir; ValueError for a change
    neither inert nor named in resume_changes."""
    recorded = _recorded_config(run_dir)
    if recorded is None:
        return []
    new = flat_config(config)
    changes = []
    for field in sorted(recorded.keys() | new.keys()):
        if field in recorded and field in new and recorded[field] == new[field]:
            continue
        change = {"field": field, **({"old": recorded[field]} if field in recorded else {}),
                  **({"new": new[field]} if field in new else {})}
        change["learned"] = not _under(field, (*_ALWAYS_INERT, *inert))
        changes.append(change)
    named = [n.strip() for n in str(new.get("resume_changes") or "").split(",") if n.strip()]
    unknown = [n for n in named if not any(_under(f, [n]) for f in recorded.keys() | new.keys())]
    if unknown:
        raise ValueError(f"--config.resume_changes names {', '.join(unknown)}: not a field of the config; name "
                         "fields as --config.<field> does (a section accepts every field in it).")
    refused = [c for c in changes if c["learned"] and not _under(c["field"], named)]
    if refused:
        accept = ",".join(dict.fromkeys([*named, *(c["field"] for c in refused)]))
        raise ValueError(f"--config.run_dir={run_dir} holds a run of another config, which this one changes in what "
                         f"it learns or how it is scored: {'; '.join(map(_show, refused))}. Start a new run with a "
                         f"new --config.run_dir, or accept exactly these changes with "
                         f"--config.resume_changes={accept}")
    return changes


def check_resume(run_dir: str, config, inert: Sequence[str] = ()) -> list[dict]:
    """The changes of `config` from the config of the run already in run_dir (none for a
    new run), as config_history.jsonl records them. A change to a field that alters what
    is learned or how it is scored raises ValueError naming each changed field as
    `old -> new`: every field is such a field unless it lies under `inert` (dotted fields
    or sections) or is named in the config's `resume_changes` ("field,field"; a section
    names every field in it). Writes nothing. Every process calls it; process 0 decides."""
    if jax.process_index() == 0:
        try:
            decision = ("changes", _compare(run_dir, config, inert))
        except ValueError as e:
            decision = ("error", str(e))
    else:
        decision = None
    kind, value = multihost.broadcast_object(decision)
    if kind == "error":
        raise ValueError(value)
    return value


def prepare_run_dir(run_dir: str, config, inert: Sequence[str] = (), *,
                    resume_step: Callable[[], int] | None = None) -> str:
    """Checks the config against the run already in run_dir (`check_resume`; a refused
    change leaves run_dir as it was), then creates run_dir and records (process 0): a new
    run's config in config.json; a resumed run's accepted changes appended to
    config_history.jsonl at `resume_step()` (the checkpoint step it resumes from, called
    only then; 0 without it), and reported in one line. config.json keeps the first config.
    Validate the config first."""
    global _checking_input
    changes = check_resume(run_dir, config, inert)
    _checking_input = False
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_index() != 0:
        return run_dir
    path = os.path.join(run_dir, CONFIG_FILENAME)
    if not os.path.exists(path):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(config.to_dict(), f, indent=2, sort_keys=True, default=str)
        os.replace(tmp, path)  # a reader never sees half a config
    elif changes:
        step = resume_step() if resume_step is not None else 0
        entry = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changes": changes}
        with open(os.path.join(run_dir, HISTORY_FILENAME), "a") as f:
            f.write(json.dumps(entry) + "\n")
        shown = ", ".join(_show(c) + (" (--config.resume_changes)" if c["learned"] else "") for c in changes)
        sys.stderr.write(f"Config changes from step {step} of {run_dir}, recorded in {HISTORY_FILENAME}: {shown}\n")
        sys.stderr.flush()
    return run_dir


def config_changes(run_dir: str) -> list[dict]:
    """The run's config changes midway, for its summary: [{"step", "changes": {field:
    "old -> new"}}], empty when its config never changed."""
    return [{"step": e["step"], "changes": {c["field"]: _show(c).split(": ", 1)[1] for c in e["changes"]}}
            for e in config_history(run_dir)]


def with_config_changes(run_dir: str, summary: dict) -> dict:
    """`summary` with the run's `config_changes` when its config changed midway."""
    changes = config_changes(run_dir)
    return {**summary, "config_changes": changes} if changes else summary


def describe_config_changes(changes: Sequence[dict] | None) -> str:
    """The report's clause for a summary's `config_changes` ("" when there are none)."""
    if not changes:
        return ""
    return "; its config changed midway: " + "; ".join(
        f"from step {e['step']}: " + ", ".join(f"{k} {v}" for k, v in e["changes"].items()) for e in changes)


def check_path(config, field: str, *, kind: str = "checkpoint", required: bool = False, hint: str = "",
               tokenizer: bool = True) -> None:
    """Raises FileNotFoundError naming --config.<field> when the path config.<field> (a
    dotted field) is given and does not exist: a Hugging Face checkpoint directory for
    kind "checkpoint", any directory for "directory". "" is the field's documented default
    (a warm start trained first, the teacher's tokenizer...) unless `required`: a mistyped
    path is never taken for it. `hint` ends the message; `tokenizer`: the checkpoint
    must hold its tokenizer too."""
    path = config
    for part in field.split("."):
        path = path[part]
    if not path and not required:
        return
    flag = f"--config.{field}"
    if kind == "checkpoint":
        try:
            check_checkpoint_dir(path, flag, tokenizer)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} {hint}".strip()) from None
    elif not os.path.isdir(path):
        raise FileNotFoundError(f"{flag}={path!r} is not a directory{'; ' + hint if hint else '.'}")


def check_checkpoint_dir(path: str, flag: str, tokenizer: bool = True) -> None:
    """Raises FileNotFoundError naming `flag` unless `path` is a Hugging Face checkpoint
    directory: a config.json, safetensors weights and (with `tokenizer`) a tokenizer."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "does not exist" if not os.path.exists(path) else "has no config.json"
    elif not any(name.endswith(".safetensors") for name in os.listdir(path)):
        what = "has no weights (*.safetensors; a torch .bin checkpoint must be re-saved with safe_serialization)"
    elif tokenizer and not any(os.path.isfile(os.path.join(path, name))
                               for name in ("tokenizer.json", "tokenizer_config.json")):
        what = "has no tokenizer (tokenizer.json / tokenizer_config.json: save the tokenizer beside the weights)"
    else:
        return
    raise FileNotFoundError(f"{flag}={path!r} {what}; pass a Hugging Face checkpoint directory (config.json, "
                            "*.safetensors and the tokenizer, as transformers' save_pretrained writes them).")


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
    cache_programs_for_any_devices()


def cache_programs_for_any_devices() -> None:
    """Keys the persistent cache's programs without the devices they run on, on every
    backend, as jax itself does on GPUs (`jax._src.cache_key`, strip_device_assignment) but
    not on CPUs: each rollout group of a CPU mesh with data > 1 (its own devices) then loads
    the program the first group compiled, placed on its own devices, rather than compiling
    the same program again. On a CPU, a program on one process's devices is also keyed
    without the process's other devices: jax hashes the whole client's topology (every
    device's process and id, and the target CPU's features), so a process of 8 devices and
    one of 4, or process 0 and process 1 of a run, never load each other's programs; here
    the topology is that of a one-device client (the same target features) and the
    program's device count. A jax without these hooks keeps its own keys."""
    from jax._src import cache_key

    hash_options = getattr(cache_key, "_hash_serialized_compile_options", None)
    hash_topology = getattr(cache_key, "_hash_accelerator_config", None)
    if hash_options is None or hash_topology is None or getattr(hash_options, "any_devices", False):
        return

    def any_devices(hash_obj, compile_options, strip_device_assignment=False):
        return hash_options(hash_obj, compile_options, strip_device_assignment=True)

    def one_process_cpu(hash_obj, devices):
        flat = list(devices.flat)
        if any(d.platform != "cpu" for d in flat) or len({d.process_index for d in flat}) > 1:
            return hash_topology(hash_obj, devices)
        hash_obj.update(_cpu_target_fingerprint().to_bytes(8, byteorder="big"))
        hash_obj.update(len(flat).to_bytes(8, byteorder="big"))

    any_devices.any_devices = True
    cache_key._hash_serialized_compile_options = any_devices
    cache_key._hash_accelerator_config = one_process_cpu


@functools.cache
def _cpu_target_fingerprint() -> int:
    """The topology fingerprint of a one-device CPU client: this machine's target CPU
    features (what a CPU program is compiled for), and no other device."""
    from jax._src.lib import xla_client

    return xla_client.get_topology_for_devices(xla_client.make_cpu_client(num_devices=1).devices()).fingerprint()


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
        except (ValueError, FileNotFoundError, ImportError, flags.ValidationError) as e:
            if not _checking_input or logging.get_verbosity() >= logging.DEBUG:
                raise
            message = " ".join(str(e).split())
            sys.stderr.write(f"Error: {message}\n(--verbosity=1 shows the traceback)\n")
            sys.exit(1)

    launcher = sys.modules["__main__"]
    launcher.__doc__ = (launcher.__doc__ or "").rstrip() + "\n\nShared flags:" + shared_help + "\n"
    app.run(launcher_main, flags_parser=_parse_flags)
