"""Every test process sees 8 simulated CPU devices, so sharded code is exercised on CPU.

Test processes use the launchers' persistent compilation cache (JAX_COMPILATION_CACHE_DIR,
or the launchers' default directory), so the many tests that compile the same small
programs, in xdist's workers and in the launchers they start, compile each once, and a
rerun on the same machine loads them.

Tests compile at XLA's lowest effort (JAX_DISABLE_MOST_OPTIMIZATIONS: backend optimisation
level 0, no expensive LLVM passes), and so does every process they start, which inherits
the variable: compiles are most of the suite's time, and this halves them (the tiny model's
train step: 2.8 s of CPU at the default level, 1.4 s here). No test checks numerics against
a program compiled at the users' level: each compares runs compiled alike, or a reference
within a tolerance. For the same reason they compile with XLA:CPU's loop emitters in place of
its fusion emitters (`tests.support.COMPILE_FLAGS`, in every process a test starts too): the
suite's CPU falls by a fifth (docs/benchmarks.md, "The suite with XLA:CPU's loop emitters").

A worker releases jax's compiled programs once its process nears the kernel's limit on
memory mappings (`_programs_within_the_map_limit`)."""
import gc
import os

from tests.support import xla_flags

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tlt_jax", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# A data=2 mesh's second rollout group loads the programs the first compiled (the launchers
# do the same: `launch.enable_compilation_cache`), for the tests that run in this process.
from tlt_jax import launch  # noqa: E402 (after the environment above, which jax reads)

launch.cache_programs_for_any_devices()

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.support import tiny  # noqa: E402


def _map_count() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


# A test adds at most a few thousand mappings (test_speculative's largest: 6,755), so a budget of
# 70% leaves room for several; each drop costs the next tests their programs' reload.
_MAP_BUDGET = _map_limit() * 7 // 10


@pytest.fixture(autouse=True)
def _programs_within_the_map_limit():
    """XLA:CPU maps each compiled program's code in many small memory mappings (a few per
    kernel), and jax's caches keep every program a process compiled: a worker that runs a
    few hundred tests holds tens of thousands of mappings. At the kernel's vm.max_map_count
    the next compile fails, and the unwinding of its error crashes the process in the C++
    unwinder (a registered frame of code freed on the failed path). So after a test that
    leaves the process above `_MAP_BUDGET`, jax's caches are dropped: the programs the
    next tests need load from the persistent compilation cache."""
    yield
    if os.path.exists("/proc/self/maps") and _map_count() > _MAP_BUDGET:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def canary(tmp_path):
    """A file outside any sandbox that a test's programs try to harm: untouched after the
    test, and no sandbox process left."""
    from tests.support import sandboxed

    path = tmp_path / "canary.txt"
    path.write_text("untouched")
    yield path
    assert path.read_text() == "untouched"
    assert not sandboxed.leftover_processes()


@pytest.fixture(scope="session")
def tiny_params():
    """The parameters of `tiny.config()` (seed 0), which every module that runs that model
    samples from: built once a process."""
    return tiny.params(tiny.config())


def pytest_collection_modifyitems(items):
    """The tests marked `costly` run first, the rest after them, each in collection order.
    xdist hands tests out in this order as workers free up, so a long test handed out last
    would keep one worker busy while the other has nothing left to run; run first, the
    short ones fill in around it (longest first)."""
    items.sort(key=lambda item: item.get_closest_marker("costly") is None)
