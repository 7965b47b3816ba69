"""Every test process sees 8 simulated CPU devices, so sharded code is exercised on CPU.

Test processes use the launchers' persistent compilation cache (JAX_COMPILATION_CACHE_DIR,
or the launchers' default directory), so the many tests that compile the same small
programs, in xdist's workers and in the launchers they start, compile each once, and a
rerun on the same machine loads them."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# For the runs that tests start as processes of their own (faults, multihost, notebooks, the
# device check, the launchers' resumes and refusals): compiles are most of such a run's time,
# and XLA's backend optimisation level 0 takes 20-40% off them. Their checks are of plumbing
# and resumes, each against a run compiled alike; the tests of the engine's exactness run in
# the test process, compiled as users' runs are.
FAST_COMPILE = "--xla_backend_optimization_level=0"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tlt_jax", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def fast_compile_env(**extra: str) -> dict:
    """The environment for a run a test starts as a process of its own: this one's, compiled
    at FAST_COMPILE (for runs checked against each other or for plumbing, not against a run
    of the test process)."""
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip(), **extra}
