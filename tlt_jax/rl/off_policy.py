"""One-step-off training: the batch a step learns was drawn by the policy one update older
than the learner's (`off_policy_steps=1`; 0, the default: synchronous steps).

Step t rolls out under the engine's weights, learns (theta_t -> theta_{t+1}) and then hands
the engine theta_t, the weights the step started from, not theta_{t+1}. Step 0 is on-policy;
from step 1 on every token the learner reads was drawn by theta_{t-1}, one version old.

This is the in-turn realisation on one device group: it yields exactly the data and the
updates of the overlapped one, where step t+1's rollout runs under theta_t while the learner
trains on step t. The overlap is what makes a step faster, and it needs the learner and the
rollout on disjoint devices (two device groups); in turn, every phase waits for the one
before it as in a synchronous step, and the step costs a copy of the weights more.

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

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

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


def _copy(params):
    """A copy of `params` in buffers of its own, laid out alike: neither the learner's update
    (which donates its state) nor the engine's layout (which may share what it is given) can
    reach it."""
    return jax.tree.map(jnp.copy, params)


class OneStepOff:
    """The engine's weights one update behind the learner's, in the learner's layout."""

    def __init__(self):
        self.params = None  # None: the engine holds the run's starting weights, the learner's own
        self.version = 0  # the step whose starting weights the engine holds
        self._started: tuple[int, object] | None = None

    def behaviour(self, learner_params):
        """The engine's weights (the learner's at the run's start)."""
        return learner_params if self.params is None else self.params

    def hold(self, step: int, params) -> None:
        """Before the learner's update: a copy of the weights step `step` starts from."""
        self._started = (step, _copy(params))

    def sync(self, engine: RolloutEngine) -> None:
        """After the update: the engine takes the weights the step started from."""
        (self.version, self.params), self._started = self._started, None
        engine.update_params(self.params)

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
