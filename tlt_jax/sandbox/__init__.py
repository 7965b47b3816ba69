"""Running untrusted programs: in bubblewrap or under resource limits (`modes`), as a uid
of their own (`uids`), each a fresh interpreter running `harness.py`, with the host
relaying and judging what they say (`relay`, `judges`); a tool's interpreter that
lives across calls (`session`).

The names below are the package's public API; the modules hold the rest.
"""
from tlt_jax.sandbox.modes import INSTALL_HINT, MODES, default_python, resolve_mode
from tlt_jax.sandbox.relay import execute, run
from tlt_jax.sandbox.session import Session
from tlt_jax.sandbox.spec import FAILURE_KINDS, Limits, Outcome, Suite, stdout_matches

__all__ = ["FAILURE_KINDS", "INSTALL_HINT", "MODES", "Limits", "Outcome", "Session", "Suite", "default_python",
           "execute", "resolve_mode", "run", "stdout_matches"]
