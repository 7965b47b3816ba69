"""The online drafter's warm-up on a thread of its own (`OnlineDrafter.warm_up(background=True)`,
what the RL run starts before plain decode compiles): the same drafter and scores as a
warm-up in the caller's thread, the first data waits for it, and its error is not lost."""
import threading

import jax
import numpy as np
import pytest

from tests.rl.test_tlt import _add_three_rows, _tiny_online
from tlt_jax.drafter_training import spot
from tlt_jax.drafter_training.online import OnlineDrafterConfig

CONFIG = OnlineDrafterConfig(batch_size=4, seq_len=12, top_k=4, eval_rows=4)


def _trained(background: bool):
    """(drafter params after two steps, the step's served metrics, drafter steps compiled)."""
    online = _tiny_online(CONFIG)
    online.warm_up(max_rows_per_step=3, background=background)
    _add_three_rows(online, 0)
    for _ in range(2):
        online.train_step(spot.ALL)
    compiled = online._trainer(online._home).step_fn(None, None, None)._cache_size()
    scores = {k: v for k, v in online.served_metrics(0).items() if not k.startswith("time_")}
    return jax.device_get(online.state.params), scores, compiled


def test_a_background_warm_up_gives_what_a_foreground_one_gives():
    params, served, compiled = _trained(background=True)
    want_params, want_served, want_compiled = _trained(background=False)
    jax.tree.map(np.testing.assert_array_equal, params, want_params)
    assert served == want_served and served["drafter/served_accept_rate"] >= 0
    assert compiled == want_compiled == 1  # the warm-up's full batch of 4 rows: the 3 held take it too


def test_the_first_data_waits_for_the_background_warm_up():
    online = _tiny_online(CONFIG)
    release = threading.Event()
    compile_run = online._compile_run
    online._compile_run = lambda *args: release.wait(timeout=60) and compile_run(*args)
    online.warm_up(max_rows_per_step=3, background=True)
    adding = threading.Thread(target=_add_three_rows, args=(online, 0))
    adding.start()
    adding.join(timeout=0.5)
    assert adding.is_alive() and online.buffer.num_rows == 0  # add waits while the warm-up has not run
    release.set()
    adding.join(timeout=60)
    assert not adding.is_alive() and online.buffer.num_rows == 3
    assert online._trainer(online._home).step_fn(None, None, None)._cache_size() == 1


def test_a_failed_background_warm_up_is_raised_at_the_first_data_and_step():
    online = _tiny_online(CONFIG)
    trainer = online._trainer(online._home)

    def broken(*args, **kwargs):
        raise RuntimeError("compile failed")

    trainer.step = broken
    online.warm_up(max_rows_per_step=3, background=True)  # the caller goes on
    with pytest.raises(RuntimeError, match="compile failed"):
        _add_three_rows(online, 0)
    with pytest.raises(RuntimeError, match="compile failed"):
        online.train_step(spot.ALL)
