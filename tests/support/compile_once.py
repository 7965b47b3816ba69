"""One compile per program in a test process, however many threads ask for it at once.

jax looks a program up in the persistent compilation cache, and on a miss compiles it and
writes it there. Two threads that miss on the same program at the same time both compile
it: the rollout groups of a data=2 engine do exactly that with each program they compile at
first use (a drafting strategy's chunk, the multi-turn observe step), since each group
compiles on a thread of its own. `compile_each_program_once` makes the second thread wait
for the first and load what it wrote; a program nobody else is compiling compiles as before.
"""
import threading

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _lock_for(cache_key: str) -> threading.Lock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(cache_key, threading.Lock())


def compile_each_program_once() -> None:
    """Wraps jax's compile-and-write-to-the-persistent-cache step: under a lock per cache
    key, the cache is read again before compiling. A jax without that step, or with another
    signature, keeps its own behaviour."""
    from jax._src import compiler

    compile_and_write = getattr(compiler, "_compile_and_write_cache", None)
    cache_read = getattr(compiler, "_cache_read", None)
    if compile_and_write is None or cache_read is None or getattr(compile_and_write, "once", False):
        return

    def once(backend, computation, executable_devices, compile_options, host_callbacks, module_name, cache_key):
        with _lock_for(cache_key):
            loaded, _ = cache_read(module_name, cache_key, compile_options, backend, executable_devices)
            if loaded is not None:
                compiler.log_persistent_cache_hit(module_name, cache_key)
                return loaded
            return compile_and_write(backend, computation, executable_devices, compile_options, host_callbacks,
                                     module_name, cache_key)

    once.once = True
    compiler._compile_and_write_cache = once
