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
within a tolerance."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tlt_jax", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# A data=2 mesh's second rollout group loads the programs the first compiled (the launchers
# do the same: `launch.enable_compilation_cache`), for the tests that run in this process.
from tlt_jax import launch  # noqa: E402 (after the environment above, which jax reads)

launch.cache_programs_for_any_devices()

import pytest  # noqa: E402

from tests.support import tiny  # noqa: E402


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
