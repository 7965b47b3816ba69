"""tests/support/compile_once.py, which tests/conftest.py turns on: two threads that reach the
same program at once (as a data=2 engine's rollout groups do) compile it once, and the second
runs what the first compiled, on its own device."""
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import compiler


def test_two_threads_on_two_devices_compile_a_new_program_once(monkeypatch):
    compiles = []
    compile_and_load = compiler.backend_compile_and_load

    def slow_compile(*args, **kwargs):
        name = str(args[1].operation.attributes["sym_name"])
        if "salted_tanh" in name:  # not the helpers jax compiles around it (device_put, conversions)
            compiles.append(name)
        time.sleep(0.5)  # both threads are in flight before the first compile is written
        return compile_and_load(*args, **kwargs)

    monkeypatch.setattr(compiler, "backend_compile_and_load", slow_compile)
    salt = float(uuid.uuid4().int % 1000)  # a program no cache has seen

    @jax.jit
    def salted_tanh(x):
        return jnp.tanh(x * salt).sum()

    start, results = threading.Barrier(2), {}

    def run(device):
        x = jax.device_put(jnp.arange(8.0), device)
        start.wait()
        results[device.id] = float(salted_tanh(x))

    threads = [threading.Thread(target=run, args=(d,)) for d in jax.devices()[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1, f"{len(compiles)} compiles of one program"
    want = float(np.tanh(np.arange(8.0) * salt).sum())
    assert sorted(results) == [d.id for d in jax.devices()[:2]]
    for got in results.values():
        np.testing.assert_allclose(got, want, rtol=1e-6)
