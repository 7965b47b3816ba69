"""Plain decode warmed up on a thread of its own while the same engine generates (what the
RL run does during the starting checkpoint's evaluation): the samples are those of an
engine that warmed up first, the warm-up's programs are the ones the rollouts then run,
and a layout's programs are made once however many threads ask for them."""
import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from tests.rl.test_train import _config, warm_start  # noqa: F401 (a fixture)
from tests.rollout.test_engine import CFG, PROMPTS, SP, _engine
from tlt_jax import background
from tlt_jax.models import transformer as tfm
from tlt_jax.rl.loop import RLLoop
from tlt_jax.rl.train import train_rl
from tlt_jax.rollout import group as group_lib
from tlt_jax.rollout.engine import RolloutEngine

GREEDY = dataclasses.replace(SP, temperature=0.0)


def _params():
    return tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)


def test_a_warm_up_beside_a_generate_changes_no_sample_and_compiles_what_rollouts_run():
    params = _params()
    first = _engine(params, 4, kv_bucket=16)
    first.warm_up(SP)
    want_eval = first.generate(PROMPTS, 1, GREEDY, jax.random.PRNGKey(3))
    compiled = first.local_groups[0].chunk_programs()  # the warm-up's chunks and the greedy eval's
    want = first.generate(PROMPTS, 3, SP, jax.random.PRNGKey(7))

    engine = _engine(params, 4, kv_bucket=16)
    warming = background.start(lambda: engine.warm_up(SP), "decode_warm_up")
    got_eval = engine.generate(PROMPTS, 1, GREEDY, jax.random.PRNGKey(3))  # the starting eval, meanwhile
    assert warming.result() > 0
    group = engine.local_groups[0]
    assert group.chunk_programs() == compiled > len(engine.rollout_config.kv_buckets)
    got = engine.generate(PROMPTS, 3, SP, jax.random.PRNGKey(7))
    assert group.chunk_programs() == compiled  # the rollout compiled no chunk
    for a, b in zip(want_eval.tokens + want.tokens, got_eval.tokens + got.tokens):
        np.testing.assert_array_equal(a, b)


def test_a_layout_s_programs_are_made_once_when_two_threads_ask_at_once(monkeypatch):
    engine = _engine(_params(), 4)
    group = engine.local_groups[0]
    jitted = group_lib.Programs.jitted

    def slow(*args):  # widens the window in which a second thread asks for the same layout
        time.sleep(0.3)
        return jitted(*args)

    monkeypatch.setattr(group_lib.Programs, "jitted", staticmethod(slow))
    spec = group.spec(speculative=False)
    got = []
    threads = [threading.Thread(target=lambda: got.append(group.programs(spec))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] is got[1] is group.programs(spec)


@pytest.mark.slow  # an RL run with background_compiles on (off by default); the engine-level waits are covered above
def test_the_first_rl_step_waits_for_plain_decode_s_warm_up(warm_start, tmp_path, monkeypatch):  # noqa: F811
    """The run evaluates its starting checkpoint while plain decode warms up; no step starts
    before the warm-up has compiled and run every chunk (a rollout would compile them), even
    a warm-up that ends after the eval."""
    events, evaluated = [], threading.Event()
    warm_up, step, evaluate = RolloutEngine.warm_up, RLLoop.step, RLLoop.evaluate

    def late_warm_up(self, *args, **kwargs):  # ends after the starting eval, whatever the machine's speed
        evaluated.wait(timeout=300)
        time.sleep(0.5)
        seconds = warm_up(self, *args, **kwargs)
        events.append("warmed up")
        return seconds

    def evaluate_then_signal(self, *args, **kwargs):
        out = evaluate(self, *args, **kwargs)
        events.append("eval")
        evaluated.set()
        return out

    monkeypatch.setattr(RolloutEngine, "warm_up", late_warm_up)
    monkeypatch.setattr(RLLoop, "evaluate", evaluate_then_signal)
    monkeypatch.setattr(RLLoop, "step", lambda self, *a, **kw: events.append("step") or step(self, *a, **kw))
    train_rl(_config(warm_start, str(tmp_path / "run"), steps=1, eval_every=1, **{"rollout.background_compiles": True}),
             progress=False)
    assert events == ["eval", "warmed up", "step", "eval"]


def test_work_over_several_devices_runs_in_the_caller_s_thread():
    """one_device=False: two threads' programs over shared devices could wait on each
    other's collectives, so the work runs at once in the caller's thread; its error is
    raised by result(), as a thread's would be."""
    ran_on = []
    done = background.start(lambda: ran_on.append(threading.current_thread()) or 7, "several", one_device=False)
    assert ran_on == [threading.current_thread()] and done.done() and done.result() == 7
    failed = background.start(lambda: 1 / 0, "several", one_device=False)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    elsewhere = background.start(lambda: threading.current_thread(), "one")
    assert elsewhere.result() is not threading.current_thread()
