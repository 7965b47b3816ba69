"""A small Qwen2 checkpoint as a user brings one, made in the test: a byte-level BPE
tokenizer trained here with a chat template and two end tokens (<|im_end|>, <|endoftext|>
in generation_config.json), random weights written by transformers."""
from experiments.make_random_hf import write_random_checkpoint
from tlt_jax.tokenizer import build_bpe_tokenizer

TEXTS = ["What is 12 + 30? Answer with <answer>42</answer>.", "Calculate 7 - 3 - 1.", "<answer>3</answer>",
         "How many legs does a spider have?", "The answer is \\boxed{\\frac{1}{2}}.", "#### 72"] * 20


def write_bpe_qwen2(out_dir: str, *, num_layers: int = 2, seed: int = 0, dtype: str = "float32",
                    max_position_embeddings: int = 256) -> str:
    tokenizer = build_bpe_tokenizer(out_dir, TEXTS, vocab_size=400)
    ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return write_random_checkpoint(out_dir, "qwen2", tokenizer=tokenizer, seed=seed, dtype=dtype,
                                   end_token_ids=ends, vocab_size=416, hidden_size=32, intermediate_size=64,
                                   num_layers=num_layers, num_heads=2, num_kv_heads=1,
                                   max_position_embeddings=max_position_embeddings)
