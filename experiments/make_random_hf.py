r"""Writes a random tiny Hugging Face checkpoint with transformers (and a char tokenizer).

  python -m experiments.make_random_hf --out /tmp/tiny_llama --family llama
  python -m experiments.check_hf --hf_dir /tmp/tiny_llama

Weights are redrawn with a larger spread than transformers' init (std 0.02, zero
biases, unit norms) so that every tensor, biases and norms included, moves the logits
and a parity check can catch a mis-mapped one.
"""
import json
import string

from absl import app, flags

# Digits, letters, punctuation, space and newline: 96 characters, ids 4..99.
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


def hf_config(family: str, *, vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=None, tie_embeddings=False, attention_bias=False,
              llama3_rope=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              max_position_embeddings=256):
    """A transformers LlamaConfig / Qwen2Config (qwen2 always has q/k/v biases)."""
    import transformers
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if llama3_rope:  # original context 16 puts the tiny model's wavelengths in all three bands
        rope = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden_size // num_heads,
                  tie_word_embeddings=tie_embeddings, rope_parameters=rope, bos_token_id=bos_token_id,
                  eos_token_id=eos_token_id, max_position_embeddings=max_position_embeddings)
    if family == "llama":
        return transformers.LlamaConfig(attention_bias=attention_bias, **kwargs)
    if attention_bias:
        raise ValueError("attention_bias is a llama option; qwen2 always has q/k/v biases.")
    return transformers.Qwen2Config(**kwargs)


def random_model(config, seed: int = 0, init_std: float = 0.1):
    """A float32 torch *ForCausalLM with every weight drawn at random: N(0, init_std)
    matrices and biases, norms 1 + N(0, 0.1). Llama's o_proj bias stays zero (our
    decoder has none, see tlt_jax.models.hf_io)."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.bias"):
                p.zero_()
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(init_std * torch.randn_like(p))
    return model.eval()


def write_random_checkpoint(out_dir: str, family: str, *, dtype: str = "float32", tokenizer=True,
                            seed: int = 0, init_std: float = 0.1, end_token_ids=None, **config_kwargs) -> str:
    """Saves `random_model(hf_config(family, **config_kwargs))` to out_dir with a tokenizer
    whose special-token ids the config uses: True, a character tokenizer; False, none; or
    a transformers tokenizer to save beside the weights (e.g. `tokenizer.build_bpe_tokenizer`'s).
    end_token_ids: several end tokens, written as generation_config.json's eos_token_id (as
    Qwen2.5-Instruct's list <|im_end|> and <|endoftext|>). Returns out_dir."""
    import torch
    if tokenizer is True:
        from tlt_jax.tokenizer import build_char_tokenizer
        tokenizer = build_char_tokenizer(out_dir, ALPHABET)
    if tokenizer:
        tokenizer.save_pretrained(out_dir)
        config_kwargs.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        vocab = config_kwargs.setdefault("vocab_size", 128)
        if vocab < len(tokenizer):
            raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer's {len(tokenizer)} tokens.")
    model = random_model(hf_config(family, **config_kwargs), seed=seed, init_std=init_std)
    if end_token_ids:
        import transformers
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=config_kwargs.get("bos_token_id"), eos_token_id=list(end_token_ids))
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)
    return out_dir


def _define_flags():
    """Flags exist only when run as a script, so tests may import the helpers above
    without claiming common flag names (--seed, --dtype) in a shared absl registry."""
    return dict(
        out=flags.DEFINE_string("out", None, "Output checkpoint directory.", required=True),
        family=flags.DEFINE_enum("family", "llama", ["llama", "qwen2"], "Model family."),
        vocab_size=flags.DEFINE_integer("vocab_size", 128, "Vocabulary size (>= the tokenizer's)."),
        hidden_size=flags.DEFINE_integer("hidden_size", 64, "Model width D."),
        intermediate_size=flags.DEFINE_integer("intermediate_size", 128, "MLP width F."),
        num_layers=flags.DEFINE_integer("num_layers", 2, "Decoder layers."),
        num_heads=flags.DEFINE_integer("num_heads", 4, "Query heads."),
        num_kv_heads=flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads."),
        tie_embeddings=flags.DEFINE_bool("tie_embeddings", False, "Tie the LM head to the embedding."),
        attention_bias=flags.DEFINE_bool("attention_bias", False, "Llama only: q/k/v (and zero o) biases."),
        llama3_rope=flags.DEFINE_bool("llama3_rope", False, "Llama-3 frequency-dependent RoPE scaling."),
        dtype=flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Stored dtype."),
        tokenizer=flags.DEFINE_bool("tokenizer", True, "Also write a character-level tokenizer."),
        seed=flags.DEFINE_integer("seed", 0, "Random seed."),
    )


def main(argv, flag_values):
    del argv
    values = {name: holder.value for name, holder in flag_values.items()}
    out, family = values.pop("out"), values.pop("family")
    write_random_checkpoint(out, family, **values)
    print(json.dumps({"out": out, "family": family, "dtype": values["dtype"]}))


if __name__ == "__main__":
    _FLAGS = _define_flags()
    app.run(lambda argv: main(argv, _FLAGS))
