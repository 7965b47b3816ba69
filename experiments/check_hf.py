r"""Parity of our forward with transformers' on a Hugging Face checkpoint.

  python -m experiments.check_hf --hf_dir=/path/to/ckpt [--prompt=TEXT] [--atol=1e-4]
  python -m experiments.check_hf --hf_dir=assets/sft_tiny
  python -m experiments.make_random_hf --out=/tmp/qwen2_tiny --family=qwen2 && \
      python -m experiments.check_hf --hf_dir=/tmp/qwen2_tiny

Loads the checkpoint twice in float32 — with `tlt_jax.models.hf_io` and with
`transformers` (torch, CPU) — runs both on the same tokens (the directory's tokenizer
applied to --prompt, or fixed ids when it has none) and prints one JSON line:
model_type, num_params, num_tokens, max_abs_diff (logits), max_abs_logit,
argmax_agreement, tol, ok. Exits with status 1 when max_abs_diff > --atol.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from tlt_jax import launch
from tlt_jax.models import hf_io
from tlt_jax.models import transformer as tfm

_HF_DIR = flags.DEFINE_string("hf_dir", None, "Checkpoint directory.", required=True)
_PROMPT = flags.DEFINE_string("prompt", "The answer to 12 + 30 is 42.\n", "Text to tokenise.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 32, "Sequence length when the directory has no tokenizer.")
_ATOL = flags.DEFINE_float("atol", 1e-4, "Largest allowed absolute logit difference.")


def token_ids(hf_dir: str, prompt: str, num_tokens: int, vocab_size: int) -> np.ndarray:
    """int32 [T]: the tokenised prompt, or a fixed pseudo-random sequence without a tokenizer."""
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) or os.path.isfile(
            os.path.join(hf_dir, "tokenizer_config.json")):
        from tlt_jax.tokenizer import load_tokenizer
        ids = np.asarray(load_tokenizer(hf_dir)(prompt)["input_ids"], np.int32)
    else:
        ids = np.random.default_rng(0).integers(0, vocab_size, num_tokens).astype(np.int32)
    if ids.size == 0 or ids.max() >= vocab_size:
        raise ValueError(f"Token ids {ids.tolist()} do not fit vocab_size={vocab_size}.")
    return ids


def compare(hf_dir: str, prompt: str, num_tokens: int, atol: float) -> dict:
    config, params = hf_io.load_hf(hf_dir, dtype="float32")
    ids_T = token_ids(hf_dir, prompt, num_tokens, config.vocab_size)

    # Highest precision: on GPUs the default float32 matmul may use TF32.
    with jax.default_matmul_precision("highest"):
        ours_TV = jax.jit(lambda p, t: tfm.logits_from_hidden(p, config, tfm.forward(p, config, t)))(
            params, jnp.asarray(ids_T)[None])[0]
    ours_TV = np.asarray(ours_TV)

    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_TV = model(torch.from_numpy(ids_T.astype(np.int64))[None]).logits[0].numpy()

    diff = float(np.max(np.abs(ours_TV - ref_TV)))
    return dict(model_type=config.model_type, num_params=config.num_params(), num_tokens=int(ids_T.size),
                max_abs_diff=diff, max_abs_logit=float(np.max(np.abs(ref_TV))),
                argmax_agreement=float(np.mean(ours_TV.argmax(-1) == ref_TV.argmax(-1))),
                tol=atol, ok=diff <= atol)


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    launch.check_checkpoint_dir(_HF_DIR.value, "--hf_dir", tokenizer=False)
    result = compare(_HF_DIR.value, _PROMPT.value, _NUM_TOKENS.value, _ATOL.value)
    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    launch.run(main)
