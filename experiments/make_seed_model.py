r"""Writes the datasets and the random base model of bench_tlt's code and planning presets.

  python -m experiments.make_seed_model --out=runs/seeds/base

The MBPP-style code set (experiments/make_code_dataset.py) into assets/code_data and the
Tower of Hanoi plans (experiments/make_plan_dataset.py) into assets/plan_data, then a
4-layer Qwen2 of random weights, shaped as experiments/make_example_model.py's, with a
byte-level BPE of 512 tokens trained on both sets' prompts and solutions (so that a
function or a move is a few tokens, not a dozen). `configs/sft.py:code` and `:plan` teach it
each task; their models and offline drafters ship as assets/sft_{code,plan} and
assets/drafter_{code,plan}.
"""
import json

from absl import app, flags

from experiments import make_code_dataset, make_plan_dataset
from experiments.make_example_model import write_bpe_qwen2

CODE_DATA, PLAN_DATA = "assets/code_data", "assets/plan_data"


def write_seed_model(out_dir: str, rows: list[dict], *, vocab_size: int = 512, hidden_size: int = 128,
                     num_layers: int = 4, seed: int = 0) -> str:
    return write_bpe_qwen2(out_dir, [r[k] for r in rows for k in ("prompt", "solution")], vocab_size=vocab_size,
                           hidden_size=hidden_size, num_layers=num_layers, intermediate_size=3 * hidden_size,
                           max_position_embeddings=512, seed=seed)


def main(argv):
    del argv
    make_code_dataset.write_dataset(CODE_DATA)
    make_plan_dataset.write_dataset(PLAN_DATA)
    rows = make_code_dataset.make_rows(2000, 0) + make_plan_dataset.make_rows(2000, 0)
    print(json.dumps({"out": write_seed_model(flags.FLAGS.out, rows, seed=flags.FLAGS.seed)}))


if __name__ == "__main__":
    flags.DEFINE_string("out", "runs/seeds/base", "Output checkpoint directory.")
    flags.DEFINE_integer("seed", 0, "Seed of the weights.")
    app.run(main)
