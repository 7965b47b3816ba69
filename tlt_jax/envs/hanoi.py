"""A planning environment: the Tower of Hanoi, one move a turn."""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from tlt_jax.envs.base import StepResult

# A move as the model writes it: "A->C" (spaces allowed around the arrow).
MOVE = re.compile(r"\b([ABC])\s*->\s*([ABC])\b")


class TowerOfHanoi:
    """A planning environment, one move a turn: move every disk from peg A to peg C,
    never a larger disk onto a smaller one. The example's `num_disks` field sets the size
    (default 3). The model writes a move as "A->C"; the observation is the new state, or
    why the move was illegal. Solved: reward 1, done; an illegal or unreadable move:
    reward 0, the state unchanged."""

    stop_strings = ()

    def __init__(self, example: dict):
        self.num_disks = int(example.get("num_disks") or 3)
        self.pegs = {"A": list(range(self.num_disks, 0, -1)), "B": [], "C": []}

    def describe(self) -> str:
        return " ".join(f"{peg}:{self.pegs[peg]}" for peg in "ABC")

    def reset(self):
        return (f"Tower of Hanoi with {self.num_disks} disks, largest 1st: {self.describe()}. Move all disks to C, "
                "one move a turn, written as A->C. Never put a larger disk on a smaller one.")

    def step(self, action: str) -> StepResult:
        move = MOVE.findall(action)
        if not move:
            return StepResult(f"No move read; write one as A->C. State: {self.describe()}")
        source, target = move[-1]
        why = illegal_move(self.pegs, source, target)
        if why:
            return StepResult(f"Illegal move {source}->{target}: {why}. State: {self.describe()}")
        self.pegs[target].append(self.pegs[source].pop())
        if solved(self.pegs, self.num_disks):
            return StepResult(None, 1.0, True)
        return StepResult(f"State: {self.describe()}")


def illegal_move(pegs: Mapping[str, list[int]], source: str, target: str) -> str:
    """Why moving the top disk of `source` onto `target` is illegal ("" when it is legal)."""
    if source == target:
        return "source and target are the same peg"
    if not pegs[source]:
        return f"peg {source} is empty"
    if pegs[target] and pegs[target][-1] < pegs[source][-1]:
        return f"disk {pegs[source][-1]} is larger than disk {pegs[target][-1]} on {target}"
    return ""


def solved(pegs: Mapping[str, list[int]], num_disks: int) -> bool:
    return pegs["C"] == list(range(num_disks, 0, -1))


def hanoi_solution(num_disks: int, source: str = "A", spare: str = "B", target: str = "C") -> list[str]:
    """The optimal moves (2^n - 1 of them) as "A->C" strings: the generator's solutions."""
    if num_disks == 0:
        return []
    return (hanoi_solution(num_disks - 1, source, target, spare) + [f"{source}->{target}"]
            + hanoi_solution(num_disks - 1, spare, source, target))


def score_moves(num_disks: int, moves: Sequence[str]) -> float:
    """1.0 when `moves` (one "X->Y" each), played from the start, are all legal and solve
    the puzzle; else 0.0: the environment's own scorer, outside any rollout."""
    env = TowerOfHanoi({"num_disks": num_disks})
    for move in moves:
        result = env.step(move)
        if result.observation is not None and result.observation.startswith(("Illegal", "No move")):
            return 0.0
        if result.done:
            return result.reward
    return 0.0

