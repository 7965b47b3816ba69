"""Work started on a thread of its own and waited for where its result is first needed:
programs compiled ahead of their first use while the caller goes on (XLA releases the GIL
while it compiles, so on a machine of few cores the compiles of two threads overlap)."""
from __future__ import annotations

import concurrent.futures
from typing import Callable


def start(fn: Callable[[], object], name: str) -> concurrent.futures.Future:
    """fn() on a new thread named after `name`; the future's `result()` waits for it and
    raises its error."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)  # the thread ends with fn
