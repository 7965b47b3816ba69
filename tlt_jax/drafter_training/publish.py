"""Which drafter the rollout engine drafts with: the online drafter's publish policies.

At each RL step's end `OnlineDrafter.publish` asks its policy which drafter the engine
gets, if any:

    EveryVersion   the drafter in training, whenever it took a step since the last
                   publish and every weight is finite (tlt.drafter.publish_scored=False)
    ScoredPublish  the best of the last step's snapshot, the served drafter and the
                   starting one, scored on the step's own samples (publish_scored=True;
                   why: the module docstring of `online`)

The scores are the step's `StepEvaluation`, made once when the step's data arrives
(`OnlineDrafter.add`): the policy reads it and so do the metrics (`evaluation_metrics`),
which write nothing. Collective with several processes: process 0's choice holds.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tlt_jax import multihost

if TYPE_CHECKING:
    from tlt_jax.drafter_training.online import OnlineDrafter


@dataclasses.dataclass(frozen=True)
class StepEvaluation:
    """Drafters scored teacher-forced on an RL step's own rows, each as
    `DrafterTrainer.evaluate`'s metrics (accept_rate, top1_agree, kl, count, and per
    training-time-test pass accept_rate_pass<i>, count_pass<i>)."""

    rl_step: int
    served: dict[str, float]  # the drafter the engine holds: the one that drafted the step's rollouts
    initial: dict[str, float]  # the run's starting drafter, on the same rows
    contenders: dict[str, dict[str, float]]  # the policy's other candidates by name (ScoredPublish: "snapshot")
    by_task: dict[str, dict[str, dict[str, float]]]  # {task: {"served"|"initial": metrics}} for a step of several
    seconds: float  # what the scoring took

    def accept_rates(self) -> dict[str, float]:
        """{candidate: accept rate}: served, initial, then the contenders."""
        return {"served": self.served["accept_rate"], "initial": self.initial["accept_rate"],
                **{name: m["accept_rate"] for name, m in self.contenders.items()}}


def evaluation_metrics(e: StepEvaluation | None) -> dict[str, float]:
    """The step's drafter metrics (`OnlineDrafter.served_metrics` lists them); {} for none."""
    if e is None:
        return {}
    by_pass = {f"drafter/served_{k}": v for k, v in e.served.items()
               if k.startswith("accept_rate_pass") and e.served[f"count_pass{k.rsplit('pass', 1)[1]}"]}
    for task, scored in e.by_task.items():
        for name in ("served", "initial"):
            if scored[name]["count"]:
                by_pass[f"drafter/{name}_accept_rate/{task}"] = scored[name]["accept_rate"]
    return {"drafter/served_accept_rate": e.served["accept_rate"], "drafter/served_top1_agree": e.served["top1_agree"],
            "drafter/served_kl": e.served["kl"], **by_pass,
            **{f"drafter/initial_{k}": e.initial[k] for k in ("accept_rate", "top1_agree", "kl")},
            **{f"drafter/{name}_accept_rate": m["accept_rate"] for name, m in e.contenders.items()},
            "time_served_eval_s": e.seconds}


class EveryVersion:
    """Publishes the drafter in training whenever it took a step since the last publish and
    every weight is finite (a non-finite drafter never reaches the engine)."""

    def __init__(self):
        self.published_steps = 0  # the drafter's steps at the last publish
        self.withheld = 0  # scored versions not published: none here

    def contenders(self, drafter: OnlineDrafter) -> dict[str, Any]:
        """Drafters the step's evaluation scores beside the served and starting ones."""
        return {}

    def choose(self, drafter: OnlineDrafter, evaluation: StepEvaluation | None) -> Any | None:
        """The parameters the engine gets now, or None: it keeps its drafter."""
        changed = drafter.steps != self.published_steps and drafter.finite()
        if not multihost.broadcast_object(changed):
            return None
        self.published_steps = drafter.steps
        return drafter.state.params

    def engine_params(self, drafter: OnlineDrafter):
        """The drafter the engine holds: the one in training (after a restore: the restored one)."""
        return drafter.state.params

    def checkpoint(self) -> tuple[dict, dict]:
        """(tree, meta) of what the policy holds, for `OnlineDrafter.checkpoint`."""
        return {}, {"published_steps": self.published_steps, "withheld": self.withheld, "chosen": False}

    def restore(self, drafter: OnlineDrafter, tree: dict, meta: dict) -> None:
        self.published_steps = meta["published_steps"]
        self.withheld = meta.get("withheld", 0)  # absent from checkpoints written before publish_scored


class ScoredPublish(EveryVersion):
    """Hands the engine the best scored on the step's samples of the last step's snapshot,
    the served drafter and the starting one (ties and no scores: the served one stays),
    then snapshots the drafter in training, if it changed and is finite, for the next step
    to score. A step's evaluation is read by one publish only."""

    def __init__(self):
        super().__init__()
        self.snapshot = None  # the drafter in training as of the last step's end (None: unchanged since)
        self.snapshot_steps = 0
        self.chosen = None  # the drafter the engine holds (None: the one in training)
        self._read: StepEvaluation | None = None  # the evaluation the last publish read

    def contenders(self, drafter: OnlineDrafter) -> dict[str, Any]:
        return {} if self.snapshot is None else {"snapshot": self.snapshot}

    def choose(self, drafter: OnlineDrafter, evaluation: StepEvaluation | None) -> Any | None:
        fresh = evaluation is not None and evaluation is not self._read
        scores = evaluation.accept_rates() if fresh else {}
        self._read = evaluation
        choice = max(scores, key=lambda name: (scores[name], name == "served")) if scores else "served"
        choice = multihost.broadcast_object(choice)
        chosen = {"snapshot": self.snapshot, "initial": drafter.initial_params()}.get(choice)
        self.withheld += "snapshot" in scores and choice != "snapshot"
        if drafter.steps != self.snapshot_steps and drafter.finite():
            self.snapshot, self.snapshot_steps = drafter.copy_params(), drafter.steps
        elif choice == "snapshot":
            self.snapshot = None  # served now: nothing new to score
        if choice == "served":
            return None
        self.chosen = chosen
        return chosen

    def engine_params(self, drafter: OnlineDrafter):
        return drafter.state.params if self.chosen is None else self.chosen

    def checkpoint(self) -> tuple[dict, dict]:
        tree, meta = super().checkpoint()
        if self.chosen is not None:  # the engine's drafter is not the one in training
            tree["chosen"] = self.chosen
        return tree, {**meta, "chosen": self.chosen is not None}

    def restore(self, drafter: OnlineDrafter, tree: dict, meta: dict) -> None:
        """The drafter the engine held, and the state as the step's end snapshot it."""
        super().restore(drafter, tree, meta)
        self.chosen = tree.get("chosen")
        self.snapshot, self.snapshot_steps = drafter.copy_params(), meta["steps"]


def publish_policy(scored: bool) -> EveryVersion:
    """The policy of tlt.drafter.publish_scored."""
    return ScoredPublish() if scored else EveryVersion()
