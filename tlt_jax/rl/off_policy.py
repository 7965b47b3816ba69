"""One-step-off training: the batch a step learns was drawn by the policy one update older
than the learner's (`off_policy_steps=1`; 0, the default: synchronous steps).

Step t rolls out under the engine's weights, learns (theta_t -> theta_{t+1}) and then hands
the engine theta_t, the weights the step started from, not theta_{t+1}. Step 0 is on-policy;
from step 1 on every token the learner reads was drawn by theta_{t-1}, one version old.

In turn, every phase waits for the one before it as in a synchronous step (and the step
costs a copy of the weights more): this yields exactly the data and the updates of the
overlapped realisation, where step t+1's rollout runs under theta_t while the learner trains
on step t. The overlap is what makes a step faster; its full gain needs the learner and the
rollout on disjoint devices (two device groups). Where every program of the run lies on one
device and nothing else shares the engine between phases (TLT off: its spot trainer and
tuner run beside the rollout; single-turn), the step overlaps on that device (`overlap`):
the engine takes theta_t before the learner runs and the next step's rollout starts on a
thread, the samples and updates bit for bit those of the in-turn run. On several devices
it stays in turn: two threads' programs over shared devices can deadlock on their
collectives (`tlt_jax/background.py`).

The importance weight: the engine records each token's log-prob under the weights that drew
it (theta_{t-1}), the learner's old log-probs are theta_t's, and GRPO's truncated importance
weight min(pi_old / pi_behaviour, tis_cap) corrects the gap (`grpo.policy_loss`), as for
partial rollouts: one-step-off needs tis_cap > 0.

Speculation verifies against the engine's weights, so it stays lossless; the drafter trains
on the learner's forward of theta_t and drafts, in the next rollout, for theta_t.

The behaviour weights (theta_t, in the learner's layout) are kept beside the train state and
checkpointed with it, so a run killed between steps resumes with the engine it had.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import background, checkpoint
from tlt_jax.rl import grpo
from tlt_jax.rl.carry import token_age_metrics
from tlt_jax.rollout.engine import RolloutEngine, Rollouts

STEPS = (0, 1)  # the off_policy_steps a run takes


def check_steps(off_policy_steps: int) -> None:
    if off_policy_steps not in STEPS:
        raise ValueError(f"off_policy_steps={off_policy_steps}: choose 0 (synchronous steps) or 1 (one-step-off: "
                         "each step learns samples drawn by the policy one update older).")


def check_config(config) -> None:
    """What one-step-off needs of the rest of the run's config."""
    steps = config.get("off_policy_steps", 0)
    check_steps(steps)
    if not steps:
        return
    grpo.require_importance_weight(config.grpo.tis_cap, f"off_policy_steps={steps}")
    if config.rollout.get("partial_share", 0.0) > 0:
        raise ValueError(f"off_policy_steps={steps} with rollout.partial_share={config.rollout.partial_share}: "
                         "choose one (set rollout.partial_share=0, or off_policy_steps=0).")


def check_resume(ckpt: checkpoint.Checkpointer, off_policy_steps: int) -> None:
    """A run resumes only the checkpoints of its own mode: one-step-off's hold the engine's
    behaviour weights, synchronous ones none."""
    step = checkpoint.resume_step(ckpt.directory)
    if not step:
        return
    saved = 1 if ckpt.read_meta(step).get("off_policy") is not None else 0
    if saved != off_policy_steps:
        raise ValueError(f"off_policy_steps={off_policy_steps}: the checkpoint of step {step} in {ckpt.directory} was "
                         f"saved with off_policy_steps={saved}, and the engine's weights do not carry across the "
                         f"two; resume with --config.off_policy_steps={saved}, or start a new --config.run_dir.")


def _copy(params):
    """A copy of `params` in buffers of its own, laid out alike: neither the learner's update
    (which donates its state) nor the engine's layout (which may share what it is given) can
    reach it."""
    return jax.tree.map(jnp.copy, params)


class OneStepOff:
    """The engine's weights one update behind the learner's, in the learner's layout."""

    def __init__(self, overlap: bool = False):
        """overlap: the next step's rollout runs on a thread while the learner trains (every
        program of the run on one device; see the module docstring)."""
        self.params = None  # None: the engine holds the run's starting weights, the learner's own
        self.version = 0  # the step whose starting weights the engine holds
        self.overlap = overlap
        self._started: tuple[int, object] | None = None
        self._next: tuple[int, concurrent.futures.Future] | None = None  # (step, its rollout under way)

    def behaviour(self, learner_params):
        """The engine's weights (the learner's at the run's start)."""
        return learner_params if self.params is None else self.params

    def hold(self, step: int, params) -> None:
        """Before the learner's update: a copy of the weights step `step` starts from."""
        self._started = (step, _copy(params))

    def sync(self, engine: RolloutEngine) -> None:
        """After the update (or before it, with the overlap): the engine takes the weights the
        step started from, once."""
        if self._started is None:
            return
        (self.version, self.params), self._started = self._started, None
        engine.update_params(self.params)

    def start_next(self, engine: RolloutEngine, step: int, rollout: Callable[[], object]) -> None:
        """With the overlap, before the learner's update of `step`: the engine takes the
        weights the step started from and `rollout` (step + 1's) starts on a thread."""
        if self.overlap:
            self.sync(engine)
            self._next = (step + 1, background.start(rollout, "next_rollout"))

    def take(self, step: int):
        """The rollout of `step` started by the step before (waited for), else None."""
        if self._next is None or self._next[0] != step:
            self.wait()
            self._next = None
            return None
        (_, done), self._next = self._next, None
        return done.result()

    def wait(self) -> None:
        """Until a rollout under way is done (before the engine serves anything else); its
        result stays for `take`."""
        if self._next is not None:
            concurrent.futures.wait([self._next[1]])

    def restore(self, engine: RolloutEngine, params, state: dict) -> None:
        """A resumed run's behaviour weights (the checkpoint's) back in the engine."""
        self.params, self.version = params, int(state["version"])
        engine.update_params(params)

    def state_dict(self) -> dict:
        return {"version": self.version}

    @contextlib.contextmanager
    def engine_holding(self, engine: RolloutEngine, params):
        """The engine holds `params` (the learner's, to evaluate them) for the block, then its
        behaviour weights again."""
        engine.update_params(params)
        try:
            yield
        finally:
            engine.update_params(self.behaviour(params))

    def metrics(self, step: int, rollouts: Rollouts) -> dict:
        """The step's token ages (`carry.token_age_metrics`): every token was drawn by the
        engine's weights; nothing is carried."""
        ages = np.full((int(np.sum(rollouts.lengths)),), step - self.version, np.int32)
        return {"carried_samples": 0, **token_age_metrics(ages)}
