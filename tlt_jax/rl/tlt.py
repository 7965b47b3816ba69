"""TLT in the RL loop: adaptive speculative rollouts and the drafter trained on the spot.

`TLT` bundles the three parts one RL step talks to:

    tuner     BucketedEpsilonGreedy, the engine's Speculation: plain decode or a drafting
              strategy per chunk, by active batch size, from measured tokens/s
    drafter   OnlineDrafter: buffer of the learner's by-products, train state, version
    spot      SpotTrainer: drafter steps in the idle gaps the loop and engine announce

and the events of a step (`RLLoop.step` calls them in this order):

    begin(step)              budget reset
    on_group_done(g)         a rollout group finished while others decode: its devices train
    after_rollout()          the group gaps close (each waits for at most one drafter step)
    gap(name)                host phases (reward scoring, batch building, checkpoint writes)
    add(...)                 the learner forward's DrafterData into the buffer
    end()                    owed catch-up steps, the new drafter to the engine (with
                             publish_scored, the best scored on the step's samples), metrics

With several processes the drafter trains on process 0 alone (its rollout groups' gaps
and the host phases; its buffer holds the whole batch's data), and each version it
publishes reaches every process's engine; every process decodes with the same tuner,
process 0's, which has heard every group's chunks (`after_rollout`).
"""
from __future__ import annotations

import contextlib
import threading

from absl import logging

from tlt_jax import multihost
from tlt_jax.drafter_training.online import OnlineDrafter
from tlt_jax.drafter_training.spot import ALL, SpotConfig, SpotTrainer
from tlt_jax.rollout import tuner as tuner_lib


class TLT:
    def __init__(self, tuner: tuner_lib.BucketedEpsilonGreedy, drafter: OnlineDrafter | None,
                 spot_config: SpotConfig):
        self.tuner, self.drafter = tuner, drafter
        self.spot = None  # where the drafter trains: process 0
        if drafter is not None and multihost.is_leader():
            self.spot = SpotTrainer(drafter.train_step, spot_config, has_data=drafter.has_data)
            self.spot.start()
        self._lock = threading.Lock()
        self._groups_done: list[int] = []
        self._num_groups = 1
        self._previous_report = tuner.report()
        self._served: dict[str, float] = {}  # the drafter's served_metrics of this RL step

    def close(self):
        if self.spot is not None:
            self.spot.close()

    # -- events of one RL step

    def begin(self, rl_step: int, num_groups: int) -> None:
        self._num_groups, self._groups_done, self._served = num_groups, [], {}
        if self.tuner.history is not None:  # the history arms' store evicts by RL step
            self.tuner.history.begin_step(rl_step)
        if self.spot is not None:
            self.spot.begin_rl_step(rl_step)

    def on_group_done(self, group: int) -> None:
        """The engine's hook (called from the group's thread)."""
        with self._lock:
            self._groups_done.append(group)
            others_running = len(self._groups_done) < self._num_groups
        if self.spot is not None and others_running:
            self.spot.open_gap(f"group{group}", group)

    def after_rollout(self) -> None:
        if self.spot is not None:
            for group in self._groups_done:  # the last one's never opened, unless other processes' groups ran
                self.spot.close_gap(f"group{group}")
        if multihost.is_multiprocess():
            self.tuner.load_state_dict(multihost.broadcast_object(self.tuner.state_dict()))

    @contextlib.contextmanager
    def gap(self, name: str):
        """A host phase during which the devices wait (the drafter trains where its state is)."""
        if self.spot is None:
            yield
            return
        with self.spot.gap(name, ALL):
            yield

    def add(self, rl_step, tokens_nT, prompt_lengths_n, response_lengths_n, drafter_data, tasks_n=None,
            observed_nT=None) -> None:
        """observed_nT: bool [n, T], the environment's observation tokens (multi-turn), which
        the drafter reads as context and never learns to predict; None: single-turn."""
        if self.spot is not None:
            self.drafter.add(rl_step, tokens_nT, prompt_lengths_n, response_lengths_n, drafter_data, tasks_n,
                             observed_nT=observed_nT)
            self._served = self.drafter.served_metrics(rl_step)  # the engine's drafter: the one that drafted it
            self.spot.notify_data()

    def end(self) -> dict:
        """Catch-up steps, the drafter to the engine; the step's TLT metrics."""
        out = {}
        if self.drafter is not None:
            if self.spot is not None:
                self.spot.catch_up()
            self.drafter.publish()
            if self.spot is not None:
                stats = self.spot.end_rl_step()
                out.update({f"spot/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
            out.update(self._served)
            out.update({"drafter_version": self.drafter.version, "drafter_steps_total": self.drafter.steps,
                        "drafter_withheld_total": self.drafter.withheld,
                        "drafter_skipped_total": self.drafter.skipped, "buffer_rows": self.drafter.buffer.num_rows,
                        "buffer_truncated_total": self.drafter.buffer.num_truncated})
        report = self.tuner.report()
        out.update(tuner_lib.report_metrics(report, self._previous_report))
        self._previous_report = report
        return out

    # -- checkpoints

    def state_dict(self) -> dict:
        out = {"tuner": self.tuner.state_dict()}
        if self.spot is not None:
            out["spot"] = self.spot.state_dict()
        return out

    def load_state_dict(self, d: dict) -> None:
        """Restores `state_dict()`'s output. A tuner whose buckets or arms changed on resume (a
        change the run accepts: speculation is lossless) starts fresh instead."""
        try:
            self.tuner.load_state_dict(d["tuner"])
        except ValueError:
            logging.warning("The tuner's buckets or arms differ from those of the resumed run: it starts fresh.")
        self._previous_report = self.tuner.report()
        if self.spot is not None and "spot" in d:
            self.spot.load_state_dict(d["spot"])
