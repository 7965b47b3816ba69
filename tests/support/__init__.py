"""What the tests share that is not a test: entry points of the processes they start,
configs they launch, modules they name (rewards, code hacks), the repository's root, and
the XLA flags of every test process."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Test processes, and the processes they start, compile with XLA:CPU's loop emitters in place
# of its fusion emitters: a fifth less of the suite's CPU (tests/conftest.py says why it may).
COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: the tests' compile flags, and `devices`
    simulated CPU devices (None: the platform's one)."""
    return COMPILE_FLAGS + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
