"""Work started on a thread of its own and waited for where its result is first needed:
programs compiled ahead of their first use while the caller goes on (XLA releases the GIL
while it compiles, so on a machine of few cores the compiles of two threads overlap)."""
from __future__ import annotations

import concurrent.futures
from typing import Callable


def start(fn: Callable[[], object], name: str, *, one_device: bool = True) -> concurrent.futures.Future:
    """fn() on a new thread named after `name`; the future's `result()` waits for it and
    raises its error. one_device=False: fn runs programs over several devices, which the
    caller's programs may share; two such programs enqueued from two threads can reach the
    devices in opposite orders and wait on each other's collectives for ever, so fn runs
    here, in the caller's thread (the future is done when this returns)."""
    if not one_device:
        done = concurrent.futures.Future()
        try:
            done.set_result(fn())
        except Exception as error:  # noqa: BLE001 (raised again by result(), as a thread's would be)
            done.set_exception(error)
        return done
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)  # the thread ends with fn
