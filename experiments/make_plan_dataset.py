r"""Writes a small planning dataset, the Tower of Hanoi solved in one answer, and its reward.

  python -m experiments.make_plan_dataset --out=assets/plan_data

Each row asks for every move of a Tower of Hanoi of `num_disks` disks from peg `source` to
peg `target` (2-4 disks, any of the six ordered pairs of pegs A, B, C), the whole plan in one
answer, the moves written as the `tower_of_hanoi` environment reads them ("A->C",
docs/agents.md): columns `prompt`, `solution` (the optimal plan, for SFT), `num_disks`,
`source`, `target`. `plan_reward` (`--config.reward=experiments.make_plan_dataset:plan_reward`)
plays the plan on the environment's own scorer, `envs.score_moves`: 1 when every move is
legal and the disks end on the target peg, else 0. The environment answers one move a turn;
here the policy writes the plan ahead, which a small model learns from a few hundred
examples in minutes.
"""
import itertools
import random

from absl import app, flags

from experiments import make_code_dataset
from tlt_jax import envs

PEGS = "ABC"
DISKS = (2, 3, 4)


def prompt_of(num_disks: int, source: str, target: str) -> str:
    return (f"Tower of Hanoi: {num_disks} disks on {source}. Move them all to {target}, one disk a move, "
            "never a larger disk on a smaller one. Plan:")


def plan_of(num_disks: int, source: str, target: str) -> str:
    """The optimal plan, its moves separated by spaces."""
    spare = next(p for p in PEGS if p not in (source, target))
    return " ".join(envs.hanoi_solution(num_disks, source, spare, target))


def plan_score(completion: str, num_disks: int, source: str, target: str) -> float:
    """1.0 when the completion's moves ("X->Y", as the environment reads them), played from all
    disks on `source`, are legal and end with all on `target`; else 0.0. The pegs are renamed
    so that the environment's scorer, which moves A to C, plays them."""
    spare = next(p for p in PEGS if p not in (source, target))
    rename = {source: "A", spare: "B", target: "C"}
    moves = envs.MOVE.findall(completion)
    return envs.score_moves(int(num_disks), [f"{rename[a]}->{rename[b]}" for a, b in moves])


def plan_reward(prompts, completions, num_disks, source, target, **_) -> list[float]:
    """The reward convention of `rewards.get_reward` (`module.path:function`)."""
    del prompts
    return [plan_score(c, n, s, t) for c, n, s, t in zip(completions, num_disks, source, target)]


def make_rows(n: int, seed: int) -> list[dict]:
    """`n` rows drawn uniformly from the 18 problems (3 sizes x 6 pairs of pegs)."""
    problems = [(d, s, t) for d in DISKS for s, t in itertools.permutations(PEGS, 2)]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d, s, t = rng.choice(problems)
        rows.append(dict(prompt=prompt_of(d, s, t), solution=plan_of(d, s, t), num_disks=d, source=s, target=t))
    return rows


def write_dataset(out_dir: str, num_train: int = 2000, num_eval: int = 64, seed: int = 0) -> dict[str, str]:
    """The plans' train.parquet and eval.parquet under out_dir; their paths by split."""
    return make_code_dataset.write_splits(out_dir, make_rows, num_train, num_eval, seed)


def main(argv):
    del argv
    paths = write_dataset(FLAGS.out, FLAGS.num_train, FLAGS.num_eval, FLAGS.seed)
    print(f"Wrote {FLAGS.num_train} training and {FLAGS.num_eval} eval rows: {paths['train']}, {paths['eval']}")


FLAGS = flags.FLAGS
if __name__ == "__main__":
    flags.DEFINE_string("out", "assets/plan_data", "Directory for train.parquet and eval.parquet.")
    flags.DEFINE_integer("num_train", 2000, "Training rows.")
    flags.DEFINE_integer("num_eval", 64, "Eval rows.")
    flags.DEFINE_integer("seed", 0, "Seed of the rows (eval: seed + 1).")
    app.run(main)
