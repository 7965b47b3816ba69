"""Every test process sees 8 simulated CPU devices, so sharded code is exercised on CPU.

The processes of one test run (xdist's workers and the launchers tests start) share one
persistent compilation cache, so the many tests that compile the same small programs
compile each once: set here by the first process (xdist's controller), inherited by the
others, empty at the start of a run unless JAX_COMPILATION_CACHE_DIR is already set (a
developer's warm cache). A size limit turns on the cache's file lock, so concurrent
processes never read an entry while another writes it."""
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tlt_jax_test_xla_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
