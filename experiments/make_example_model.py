r"""Writes the small "pretrained" checkpoint of the README's CPU example of real data.

  python -m experiments.make_example_model --out=runs/example/base

No pretrained weights can be downloaded, so the example makes a model shaped like what a
user brings: a Qwen2 checkpoint written by transformers, with a byte-level BPE tokenizer
trained here on reasoning-gym text, Qwen2.5-Instruct's ChatML chat template and its two
end tokens (<|im_end|> in config.json, <|im_end|> and <|endoftext|> in
generation_config.json). Its weights are random: `experiments.sft` then teaches it the
answer format on a few reasoning-gym tasks, and `experiments.train_rl` takes it from there.
"""
import json

from absl import app, flags

from experiments.make_random_hf import write_random_checkpoint

TASKS = ("basic_arithmetic", "chain_sum", "leg_counting")


def corpus(tasks=TASKS, per_task: int = 400, seed: int = 0) -> list[str]:
    """Questions and <answer>-tagged answers of the tasks: the tokenizer's training text."""
    from tlt_jax.data import reasoning_gym_problems

    rg = reasoning_gym_problems.import_reasoning_gym()
    texts = []
    for name in tasks:
        for entry in rg.create_dataset(name, size=per_task, seed=seed):
            texts += [entry["question"], f"<answer>{entry['answer']}</answer>"]
    return texts


def write_bpe_qwen2(out_dir: str, texts: list[str], *, vocab_size: int, hidden_size: int, num_layers: int,
                    intermediate_size: int, max_position_embeddings: int, seed: int = 0) -> str:
    """A random Qwen2 checkpoint (4 heads, 2 kv heads, tied embeddings) with a byte-level BPE
    trained on `texts`, ChatML's two end tokens; returns out_dir."""
    from tlt_jax.tokenizer import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer(out_dir, texts, vocab_size=vocab_size)
    ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return write_random_checkpoint(out_dir, "qwen2", tokenizer=tokenizer, seed=seed, init_std=0.02,
                                   end_token_ids=ends, vocab_size=len(tokenizer), hidden_size=hidden_size,
                                   intermediate_size=intermediate_size, num_layers=num_layers, num_heads=4,
                                   num_kv_heads=2, tie_embeddings=True, max_position_embeddings=max_position_embeddings)


def write_example_model(out_dir: str, *, vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 4,
                        seed: int = 0) -> str:
    return write_bpe_qwen2(out_dir, corpus(seed=seed), vocab_size=vocab_size, hidden_size=hidden_size,
                           num_layers=num_layers, intermediate_size=4 * hidden_size, max_position_embeddings=1024,
                           seed=seed)


def main(argv):
    del argv
    out = write_example_model(flags.FLAGS.out, seed=flags.FLAGS.seed)
    print(json.dumps({"out": out}))


if __name__ == "__main__":
    flags.DEFINE_string("out", "runs/example/base", "Output checkpoint directory.")
    flags.DEFINE_integer("seed", 0, "Seed of the corpus and the weights.")
    app.run(main)
