"""The offline trainers' shared step loop: cadences, resume, and closing."""
from tlt_jax.train_state import run_steps


class _Log:
    """Stands in for the checkpointer, the metrics writer and the progress bar."""

    def __init__(self):
        self.events = []

    def save(self, step, state, meta):
        self.events.append(("save", step, state, meta["step"]))

    def write(self, step, record):
        self.events.append(("write", step, dict(record)))

    def update(self, record):
        self.events.append(("bar", dict(record)))

    def wait(self):
        self.events.append(("wait",))

    def close(self):
        self.events.append(("close",))


def _run(start, steps=5):
    log = _Log()
    state, record, seconds = run_steps(
        start, start=start, steps=steps, eval_every=2, checkpoint_every=3, ckpt=log, writer=log, bar=log,
        step_fn=lambda state, step: (state + 1, {"loss": float(step)}),
        eval_fn=lambda state, step: {"eval": float(10 * step + state)})
    return state, record, seconds, log.events


def test_fresh_run_evaluates_and_saves_on_cadence_and_at_the_end():
    state, record, seconds, events = _run(0)
    assert state == 5 and record == {"loss": 4.0, "eval": 55.0} and seconds >= 0
    assert [e[1] for e in events if e[0] == "write" and "eval" in e[2]] == [2, 4, 5]
    assert [e[1:] for e in events if e[0] == "save"] == [(3, 3, 3), (5, 5, 5)]
    assert [e[1] for e in events if e[0] == "write"] == [1, 2, 3, 4, 5]
    assert events[-4:] == [("close",), ("wait",), ("close",), ("close",)]  # bar, then ckpt wait+close, writer


def test_resumed_run_continues_and_a_finished_run_only_evaluates():
    state, record, _, events = _run(3)
    assert state == 5 and [e[1] for e in events if e[0] == "write"] == [4, 5]
    assert [e[1] for e in events if e[0] == "save"] == [5]
    state, record, _, events = _run(5)
    assert state == 5 and record == {"eval": 55.0}
    assert not [e for e in events if e[0] in ("write", "save", "bar")]
