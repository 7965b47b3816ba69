"""Partial rollouts: a step stops waiting for its long tail and carries it over.

With `rollout.partial_share` = s > 0 a step's rollout stops on each rollout group once a
share s of the samples it runs there has finished (and at least one whole GRPO group is
done, so that every step learns something). The samples still decoding keep their tokens
and each token's log-prob under the policy that drew it; the next step resumes them under
its own weights (prompt and tokens re-prefilled, `rollout.engine.PartialRequests`).

- Groups are carried whole: a prompt's G samples are learned together, in the step where
  the last of them finishes, and each sample exactly once.
- A step takes `prompts_per_step` fresh prompts from the train stream, as a synchronous step
  does, and runs them beside the carried groups. What it learns varies from step to step
  (the groups that completed), but every group started is learned within max_carry_steps,
  so on average a step learns prompts_per_step groups: the learner's batch stays about the
  synchronous one, and the slots the long tail would leave idle decode the next groups.
- A sample's randomness follows the sample, not the step: its key is the run's partial
  stream folded with (its prompt's place in the train stream, its index, the token's
  position), so with the weights unchanged a carried sample draws exactly the tokens it
  would have drawn uncarried.
- `rollout.max_carry_steps` = m bounds a token's age (the steps between the policy that
  drew it and the one that learns from it) by m: a group that started m steps ago is due,
  and the step runs its samples to the end before it stops. Neither truncated (the reward
  of a cut answer) nor restarted (which would favour short answers: long ones would keep
  restarting), a due sample's only cost is one step that waits for it.
- The learner's importance weight is per token: each token's behaviour log-prob is the
  drawing policy's (`grpo.GRPOConfig.tis_cap` truncates pi_old / pi_behaviour), so partial
  rollouts need TIS on.

The groups in flight are part of the checkpoint (`state_dict`), so a run killed between
steps resumes mid-carry exactly.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from tlt_jax.rollout.engine import PartialRequests, Rollouts

STREAM = 0x7FFFFFFE  # the partial rollouts' sampling keys: one stream for the run, not one per step


@dataclasses.dataclass(frozen=True)
class PartialConfig:
    """share: a step's rollout stops once this share of its samples has finished (0: off,
    every step waits for all of them). max_carry_steps: the most steps a token waits
    between the policy that drew it and the update that learns from it."""

    share: float = 0.0
    max_carry_steps: int = 2

    def __post_init__(self):
        if not 0 <= self.share <= 1:
            raise ValueError(f"partial_share={self.share} must lie in [0, 1] (0: off; e.g. 0.7 stops a step's rollout "
                             "once 70% of its samples have finished).")
        if self.max_carry_steps < 1:
            raise ValueError(f"max_carry_steps={self.max_carry_steps} must be >= 1 (the most steps a carried token "
                             "waits before it is learned).")

    @property
    def enabled(self) -> bool:
        return self.share > 0


@dataclasses.dataclass(eq=False)
class InFlight:
    """One prompt's G samples between the step that started them and the one that learns them."""

    data_position: int  # the prompt's place in the train stream: names its samples' keys
    start_step: int
    tokens: list[np.ndarray]  # per sample, int32: drawn so far
    logprobs: list[np.ndarray]  # per sample, float32: each token's under the policy that drew it
    drawn_at: list[np.ndarray]  # per sample, int32: the step whose policy drew each token
    finish_reason: list[str]  # "" while unfinished

    @classmethod
    def fresh(cls, data_position: int, step: int, num_samples: int) -> InFlight:
        empty = lambda dtype: [np.zeros((0,), dtype) for _ in range(num_samples)]
        return cls(data_position, step, empty(np.int32), empty(np.float32), empty(np.int32), [""] * num_samples)

    @property
    def done(self) -> bool:
        return all(self.finish_reason)

    def to_json(self) -> dict:
        return {"data_position": self.data_position, "start_step": self.start_step,
                "tokens": [t.tolist() for t in self.tokens], "logprobs": [lp.tolist() for lp in self.logprobs],
                "drawn_at": [d.tolist() for d in self.drawn_at], "finish_reason": list(self.finish_reason)}

    @classmethod
    def from_json(cls, d: dict) -> InFlight:
        arrays = lambda key, dtype: [np.asarray(x, dtype) for x in d[key]]
        return cls(int(d["data_position"]), int(d["start_step"]), arrays("tokens", np.int32),
                   arrays("logprobs", np.float32), arrays("drawn_at", np.int32), list(d["finish_reason"]))


def token_age_metrics(ages: np.ndarray) -> dict:
    """Of a step's learned tokens, given each one's age (the steps from the policy that drew
    it to the one that learns from it; partial rollouts and one-step-off): token_age_mean,
    token_age_max, and stale_token_share, the share an older policy drew."""
    return {"token_age_mean": float(ages.mean()) if ages.size else 0.0, "token_age_max": int(ages.max(initial=0)),
            "stale_token_share": float((ages > 0).mean()) if ages.size else 0.0}


@dataclasses.dataclass(frozen=True)
class Learned:
    """What a step's partial rollout hands the learner: the groups completed in it."""

    groups: list[InFlight]
    rollouts: Rollouts  # their samples, prompt-major (prompt i: groups[i]), this step's timeline
    metrics: dict


class Carry:
    """The groups in flight across steps (`rollout.partial_share` > 0)."""

    def __init__(self, config: PartialConfig, prompts_per_step: int, num_samples: int):
        self.config, self.prompts_per_step, self.num_samples = config, prompts_per_step, num_samples
        self.in_flight: list[InFlight] = []

    def start(self, step: int, data_position: int) -> tuple[list[InFlight], int]:
        """The step's groups (the carried ones first, then prompts_per_step fresh prompts)
        and how many fresh prompts it took from the train stream."""
        fresh = self.prompts_per_step
        self.in_flight += [InFlight.fresh(data_position + i, step, self.num_samples) for i in range(fresh)]
        return list(self.in_flight), fresh

    def requests(self, step: int) -> PartialRequests:
        """The engine's requests of the groups in flight (prompt i: in_flight[i]): their
        unfinished samples, resuming what they drew, and the step's stop rule."""
        g, share, groups = self.num_samples, self.config.share, self.in_flight
        samples = [i * g + s for i, group in enumerate(groups) for s in range(g) if not group.finish_reason[s]]
        resumed = {i * g + s: (group.tokens[s], group.logprobs[s]) for i, group in enumerate(groups)
                   for s in range(g) if not group.finish_reason[s] and len(group.tokens[s])}
        due = {i * g + s for i, group in enumerate(groups) if step - group.start_step >= self.config.max_carry_steps
               for s in range(g)}

        def stop(finished: set, running: list) -> bool:
            if len(finished) < math.ceil(share * len(running)) or not due.isdisjoint(set(running) - finished):
                return False
            # At least one of this rollout group's prompts is complete: the step learns something.
            return any(all(r in finished for r in running if r // g == p) for p in {r // g for r in running})

        return PartialRequests(samples, resumed, stop)

    def absorb(self, step: int, rollouts: Rollouts) -> Learned:
        """The engine's results into the groups in flight; the completed groups leave and
        are returned for the learner, the rest stay carried."""
        g = self.num_samples
        for i in range(len(rollouts)):
            group, s = self.in_flight[int(rollouts.prompt_index[i])], int(rollouts.sample_index[i])
            drawn = len(rollouts.tokens[i]) - len(group.tokens[s])
            group.tokens[s], group.logprobs[s] = rollouts.tokens[i], rollouts.logprobs[i]
            group.drawn_at[s] = np.concatenate([group.drawn_at[s], np.full((drawn,), step, np.int32)])
            group.finish_reason[s] = rollouts.finish_reason[i]
        learned = [group for group in self.in_flight if group.done]
        self.in_flight = [group for group in self.in_flight if not group.done]
        samples = [(i, s) for i in range(len(learned)) for s in range(g)]
        merged = Rollouts(
            prompt_index=np.asarray([i for i, _ in samples], np.int32),
            sample_index=np.asarray([s for _, s in samples], np.int32),
            tokens=[learned[i].tokens[s] for i, s in samples], logprobs=[learned[i].logprobs[s] for i, s in samples],
            finish_reason=[learned[i].finish_reason[s] for i, s in samples],
            group=np.zeros(len(samples), np.int32), timeline=rollouts.timeline)
        return Learned(learned, merged, self._metrics(step, learned))

    def _metrics(self, step: int, learned: list[InFlight]) -> dict:
        """carried_samples: unfinished samples carried to the next step; token ages (steps
        from the drawing policy to this update) over the learned tokens; stale_token_share:
        of those, the tokens an older policy drew."""
        ages = np.concatenate([step - d for group in learned for d in group.drawn_at] or [np.zeros((0,), np.int32)])
        return {"carried_samples": sum(not r for group in self.in_flight for r in group.finish_reason),
                "carried_groups": len(self.in_flight), "learned_groups": len(learned),
                "learned_samples": len(learned) * self.num_samples, **token_age_metrics(ages)}

    def state_dict(self) -> list[dict]:
        return [group.to_json() for group in self.in_flight]

    def load_state_dict(self, state: list[dict] | None) -> None:
        self.in_flight = [InFlight.from_json(d) for d in state or []]
