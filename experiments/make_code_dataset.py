r"""Writes a small MBPP-style code dataset: the README's and docs/code.md's CPU example.

  python -m experiments.make_code_dataset --out=runs/example/code

Each row is a short programming task with MBPP's columns: `prompt` (asking for one Python
function in a fenced block), `test_list` (three assert statements), `test_setup_code`,
and `solution` (a reference answer in a fenced block, for SFT or a sanity check). The
tasks are procedural (a few templates with random names and constants), so the files
are made here, offline: `train.parquet` and `eval.parquet` under --out, scored by
`--config.reward=code` with `--config.data.answer_field=''`.
"""
import os
import random

from absl import app, flags

# (what the function does, with {k}; its signature; its body; its argument drawn from rng)
_TEMPLATES = (
    ("returns x plus {k}", "add_{k}(x)", "return x + {k}", lambda rng: rng.randint(-50, 50)),
    ("returns x times {k}", "times_{k}(x)", "return x * {k}", lambda rng: rng.randint(-20, 20)),
    ("returns True when x is a multiple of {k}, else False", "is_multiple_of_{k}(x)", "return x % {k} == 0",
     lambda rng: rng.randint(0, 60)),
    ("returns the sum of the list xs plus {k}", "sum_plus_{k}(xs)", "return sum(xs) + {k}",
     lambda rng: [rng.randint(0, 9) for _ in range(rng.randint(0, 5))]),
    ("returns the text s repeated {k} times", "repeat_{k}(s)", "return s * {k}",
     lambda rng: "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))),
    ("returns the greatest common divisor of x and {k} (math is imported)", "gcd_with_{k}(x)",
     "return math.gcd(x, {k})", lambda rng: rng.randint(1, 100)),
)
FLAGS = flags.FLAGS


def make_rows(n: int, seed: int) -> list[dict]:
    """`n` tasks: prompt, test_list (3 asserts), test_setup_code, solution."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        what, signature, body, draw = rng.choice(_TEMPLATES)
        k = rng.randint(2, 9)
        signature, body = signature.format(k=k), body.format(k=k)
        name = signature.split("(")[0]
        uses_math = "math." in body
        reference = f"def {signature}:\n    {body}\n"
        namespace = {}
        exec(("import math\n" if uses_math else "") + reference, namespace)  # the expected values
        args = [draw(rng) for _ in range(3)]
        rows.append({
            "prompt": f"Write a Python function {signature} that {what.format(k=k)}. Answer in a ```python block.",
            "test_list": [f"assert {name}({a!r}) == {namespace[name](a)!r}" for a in args],
            "test_setup_code": "import math" if uses_math else "",
            "solution": f"```python\n{reference}```",
        })
    return rows


def write_splits(out_dir: str, rows_of, num_train: int, num_eval: int, seed: int) -> dict[str, str]:
    """train.parquet and eval.parquet under out_dir, rows from rows_of(n, seed) (eval's seed is
    seed + 1); their paths by split."""
    import datasets

    datasets.disable_progress_bars()
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, n, split_seed in (("train", num_train, seed), ("eval", num_eval, seed + 1)):
        paths[split] = os.path.join(out_dir, f"{split}.parquet")
        datasets.Dataset.from_list(rows_of(n, split_seed)).to_parquet(paths[split])
    return paths


def write_dataset(out_dir: str, num_train: int = 2000, num_eval: int = 64, seed: int = 0) -> dict[str, str]:
    """The code tasks' train.parquet and eval.parquet under out_dir; their paths by split."""
    return write_splits(out_dir, make_rows, num_train, num_eval, seed)


def main(argv):
    del argv
    paths = write_dataset(FLAGS.out, FLAGS.num_train, FLAGS.num_eval, FLAGS.seed)
    print(f"Wrote {FLAGS.num_train} training and {FLAGS.num_eval} eval tasks: {paths['train']}, {paths['eval']}")


if __name__ == "__main__":
    flags.DEFINE_string("out", "runs/example/code", "Directory for train.parquet and eval.parquet.")
    flags.DEFINE_integer("num_train", 2000, "Training tasks.")
    flags.DEFINE_integer("num_eval", 64, "Eval tasks.")
    flags.DEFINE_integer("seed", 0, "Seed of the tasks (eval: seed + 1).")
    app.run(main)
