"""Rollout instrumentation: the long tail made visible.

Each data-parallel group records its decode chunks (a chunk is several decode steps run
on the device between two host syncs): wall-clock start and end, and per step the
number of active sequences and tokens committed. Steps inside a chunk share its wall
time evenly (the device does not report per-step times without a sync per step).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

# The parts of a rollout's wall time (`RolloutTimeline.summary`'s `<part>_s`).
ROLLOUT_PARTS = ("chunks", "prefill", "harvest", "host")


@dataclasses.dataclass
class Chunk:
    start: float
    end: float
    active_per_step: list[int]
    tokens_per_step: list[int]
    kind: str = "decode"  # "decode", or "speculative": one draft-and-verify step


@dataclasses.dataclass
class SpecChunk(Chunk):
    """Speculative steps of one strategy: the tokens each active sequence committed per
    step (accepted drafts plus the bonus token, flattened over steps) and, for a chunk
    of one step timed phase by phase (`RolloutConfig.time_spec_phases`), where the time
    went (zero otherwise)."""

    kind: str = "speculative"
    strategy: str = ""
    committed_per_sequence: list[int] = dataclasses.field(default_factory=list)
    depth: int = 0  # drafts per step: the most a step can accept (the strategy's depth)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per sequence in this verify step, bonus included."""
        return sum(self.committed_per_sequence) / max(1, len(self.committed_per_sequence))


@dataclasses.dataclass
class GroupTimeline:
    group: int
    num_slots: int
    start: float = 0.0
    end: float = 0.0
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    # Host seconds between chunks spent prefilling new prompts and harvesting finished
    # samples (each up to its results on the host); the rest of the gaps is the policy,
    # the dispatch and Python.
    prefill_s: float = 0.0
    harvest_s: float = 0.0

    @property
    def chunks_s(self) -> float:
        """The chunks' wall time, summed."""
        return sum(c.end - c.start for c in self.chunks)

    def between_s(self) -> dict[str, float]:
        """The wall time outside chunks, by part: prefill, harvest, other (the rest)."""
        outside = self.end - self.start - self.chunks_s
        return dict(prefill=self.prefill_s, harvest=self.harvest_s,
                    other=outside - self.prefill_s - self.harvest_s)

    def steps(self):
        """(time, active sequences, tokens committed) per decode step."""
        out = []
        for chunk in self.chunks:
            n = len(chunk.active_per_step)
            if n == 0:
                continue
            dt = (chunk.end - chunk.start) / n
            for i, (active, tokens) in enumerate(zip(chunk.active_per_step, chunk.tokens_per_step)):
                out.append((chunk.start + (i + 0.5) * dt, active, tokens))
        return out

    @property
    def tokens(self) -> int:
        return sum(sum(c.tokens_per_step) for c in self.chunks)

    def slot_utilisation(self) -> float:
        """Busy slot-steps over all slot-steps of the decode steps run."""
        steps = self.steps()
        return sum(a for _, a, _ in steps) / max(1, len(steps) * self.num_slots)


@dataclasses.dataclass
class RolloutTimeline:
    groups: list[GroupTimeline]
    origin: float = dataclasses.field(default_factory=time.perf_counter)

    def acceptance_by_depth(self) -> list[float | None]:
        """Per draft position d = 1, 2, ...: of the sequence-steps whose first d - 1 drafts
        were accepted, under strategies drafting at least d deep, the share whose d-th draft
        was accepted too. Read from the tokens committed (accepted drafts plus the bonus), so a
        sequence that ended inside a step (its end token, max_tokens) counts as a rejection at
        the position after its last token. None: a position no step reached."""
        spec = [c for g in self.groups for c in g.chunks if isinstance(c, SpecChunk)]
        depth = max((c.depth for c in spec), default=0)
        reached, passed = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
        d = np.arange(depth)
        for c in spec:
            accepted = np.minimum(np.asarray(c.committed_per_sequence, np.int64) - 1, c.depth)
            # Position d (0-based) is reached when d drafts were accepted, and passed on d + 1.
            reached += np.sum((accepted[:, None] >= d) & (d < c.depth), axis=0)
            passed += np.sum((accepted[:, None] > d) & (d < c.depth), axis=0)
        return [float(p / r) if r else None for p, r in zip(passed, reached)]

    def summary(self) -> dict:
        """Wall time, tokens/s, and the two long-tail losses.

        group_idle_s / group_idle_fraction: device time spent by groups that finished
        waiting for the slowest one (seconds summed over groups; share of groups x wall).
        slot_idle_fraction: decode slots stepping with no sequence in them.
        chunks_s, prefill_s, harvest_s, host_s: where the groups' wall went (seconds summed
        over groups): inside decode chunks, prefilling, harvesting, and the rest of the gaps
        between chunks (the policy, dispatch, Python).
        """
        if not self.groups:
            return dict(wall_s=0.0, tokens=0, tokens_per_s=0.0, group_idle_s=0.0, group_idle_fraction=0.0,
                        slot_idle_fraction=0.0, decode_steps=0, speculative_steps=0, speculative_tokens=0,
                        acceptance_length=0.0, draft_s=0.0, verify_s=0.0, chunks_s=0.0, prefill_s=0.0,
                        harvest_s=0.0, host_s=0.0)
        start = min(g.start for g in self.groups)
        end = max(g.end for g in self.groups)
        wall = max(end - start, 1e-9)
        idle_s = sum(end - g.end for g in self.groups)
        steps = [s for g in self.groups for s in g.steps()]
        slot_steps = sum(len(g.steps()) * g.num_slots for g in self.groups)
        busy = sum(a for _, a, _ in steps)
        tokens = sum(g.tokens for g in self.groups)
        spec = [c for g in self.groups for c in g.chunks if isinstance(c, SpecChunk)]
        committed = [n for c in spec for n in c.committed_per_sequence]
        between = [g.between_s() for g in self.groups]
        return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, group_idle_s=idle_s,
                    group_idle_fraction=idle_s / (wall * len(self.groups)),
                    slot_idle_fraction=1 - busy / max(1, slot_steps),
                    decode_steps=max((len(g.steps()) for g in self.groups), default=0),
                    speculative_steps=sum(len(c.active_per_step) for c in spec),
                    speculative_tokens=sum(committed),
                    acceptance_length=sum(committed) / len(committed) if committed else 0.0,
                    draft_s=sum(c.draft_s for c in spec), verify_s=sum(c.verify_s for c in spec),
                    chunks_s=sum(g.chunks_s for g in self.groups),
                    prefill_s=sum(b["prefill"] for b in between), harvest_s=sum(b["harvest"] for b in between),
                    host_s=sum(b["other"] for b in between))
