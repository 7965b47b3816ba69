# %% [markdown]
# # Your Hugging Face checkpoint: load, check, roll out, train, save
#
# Llama-3 and Qwen2 checkpoints come in and go out in the Hugging Face format (`config.json` plus safetensors;
# `tlt_jax.models.hf_io`). Nothing is downloaded: this notebook writes a small random checkpoint with
# transformers itself, then
#
# 1. loads it with `hf_io.load_hf` and checks our logits against transformers' PyTorch forward;
# 2. rolls it out with the JAX engine;
# 3. trains it one GRPO step;
# 4. saves it back with `hf_io.save_hf` and reloads it, in transformers and here.
#
# To try your own Llama or Qwen2 checkpoint, set `HF_DIR` to its directory and, in place of the cell that writes
# one, load `hf_model = transformers.AutoModelForCausalLM.from_pretrained(HF_DIR, dtype=torch.float32)` and
# `tokenizer = tlt_jax.tokenizer.load_tokenizer(HF_DIR)`. `python -m experiments.check_hf --hf_dir=...` runs the
# same parity check from the command line.

# %%
import os

import jax

# TLT_NOTEBOOK_SMOKE=1 shrinks everything to seconds (what the tests execute).
SMOKE = os.environ.get("TLT_NOTEBOOK_SMOKE") == "1"
ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
RUNS = os.environ.get("TLT_NOTEBOOK_RUNS", "runs/colab")
WORK_DIR = os.path.join(RUNS, "04_hf_checkpoint")
HF_DIR = os.path.join(WORK_DIR, "random_qwen2")
# A rerun skips its compiles; the cache the launchers use (JAX_COMPILATION_CACHE_DIR) where one is set.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(RUNS, "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

if SMOKE:
    MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    PROMPTS, SAMPLES, MAX_TOKENS = 4, 4, 24
elif ACCELERATOR:
    MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2)
    PROMPTS, SAMPLES, MAX_TOKENS = 32, 8, 96
else:
    MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    PROMPTS, SAMPLES, MAX_TOKENS = 16, 8, 48
print(f"backend {jax.default_backend()}; model {MODEL}")

# %% [markdown]
# ## A checkpoint written by transformers
#
# A Qwen2 model (q/k/v biases, grouped-query attention, tied embeddings) with random weights, and the character
# tokenizer of the project's synthetic tasks, saved the way any Hugging Face checkpoint is.

# %%
import shutil

import torch
import transformers

from tlt_jax.data import tasks

shutil.rmtree(WORK_DIR, ignore_errors=True)
tokenizer = tasks.build_task_tokenizer(HF_DIR)  # writes tokenizer.json and tokenizer_config.json
hf_config = transformers.Qwen2Config(
    vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, max_position_embeddings=256,
    initializer_range=0.1, **MODEL)
torch.manual_seed(0)
hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
with torch.no_grad():  # biases and norms start at 0 and 1; random ones make the parity check see them
    for name, p in hf_model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.add_(0.1 * torch.randn_like(p))
hf_model.save_pretrained(HF_DIR)
sorted(os.listdir(HF_DIR))

# %% [markdown]
# ## Load it, and check it against transformers
#
# `load_hf` maps the checkpoint's config to our `ModelConfig` and its tensors to our parameter layout (host
# arrays; any sharding is applied later). The forward of `tlt_jax.models.transformer` should give transformers'
# logits up to float32 rounding.

# %%
import jax.numpy as jnp
import numpy as np

from tlt_jax.models import hf_io
from tlt_jax.models import transformer as tfm

model_cfg, params = hf_io.load_hf(HF_DIR)
print(model_cfg)
print(f"{model_cfg.num_params() / 1e6:.2f}M parameters")


def our_logits(params, ids):
    h = tfm.forward(params, model_cfg, jnp.asarray(ids, jnp.int32)[None])
    return np.asarray(tfm.logits_from_hidden(params, model_cfg, h)[0])


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0].float().numpy()


probe = tokenizer("add 1234+5678\n1+8=9\n")["input_ids"]
ours, theirs = our_logits(params, probe), torch_logits(hf_model, probe)
print(f"max |logit difference| over {len(probe)} positions: {np.abs(ours - theirs).max():.2e}")
np.testing.assert_allclose(ours, theirs, atol=1e-4)

# %%
import matplotlib.pyplot as plt

plt.figure(figsize=(4.5, 4.5))
plt.scatter(theirs.ravel(), ours.ravel(), s=4, alpha=0.5)
lim = [min(ours.min(), theirs.min()), max(ours.max(), theirs.max())]
plt.plot(lim, lim, color="0.5", lw=0.8)
plt.xlabel("transformers (PyTorch) logits")
plt.ylabel("tlt_jax logits")
plt.title(f"{model_cfg.model_type}: max difference {np.abs(ours - theirs).max():.1e}")
plt.show()

# %% [markdown]
# ## Roll it out
#
# The rollout engine runs continuous batching over KV-cache slots; here G answers for each of a few addition
# prompts at temperature 1. A random model writes random characters, of course.

# %%
from tlt_jax import evaluation, sampling, sharding
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
engine = RolloutEngine(model_cfg, params, mesh, RolloutConfig(
    num_slots=PROMPTS * SAMPLES, max_prompt_length=24, max_length=24 + MAX_TOKENS,
    eos_token_id=model_cfg.eos_token_id))
sp = sampling.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
examples = tasks.make_split(tasks.get_task("addition", max_digits=3), "train", PROMPTS, seed=0)
prompt_ids = evaluation.encode_prompts(tokenizer, examples)
rollouts = engine.generate(prompt_ids, SAMPLES, sp, jax.random.PRNGKey(0))
completions = evaluation.decode_completions(tokenizer, rollouts.tokens)
for i in range(3):
    print(f"{examples[rollouts.prompt_index[i]].prompt.strip()!r} -> {completions[i]!r}")
print(f"{len(rollouts)} answers of {rollouts.lengths.mean():.1f} tokens on average "
      f"({sum(r == 'max_tokens' for r in rollouts.finish_reason)} cut at max_tokens)")

# %% [markdown]
# ## One GRPO step
#
# GRPO needs a reward per answer; the task's reward (a correct, well-formed answer) is 0 for every answer of a
# random model, which gives GRPO nothing to learn from. Any callable `(prompts, completions, **fields) -> scores`
# is a reward, so here is a toy one with some spread: the share of digits in the answer. Advantages are the
# rewards normalised within each prompt's group of G; the learner packs the samples into rows, takes the
# old-policy log-probs through the fused kernel, and makes one clipped policy-gradient update. Afterwards each
# answer's log-probability has moved with its advantage.

# %%
from tlt_jax import rewards
from tlt_jax.rl import grpo, loop
from tlt_jax.rl.learner import Learner, LearnerConfig
from tlt_jax.train_state import OptimizerConfig


def digit_share(prompts, completions, **fields):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


prompts = [examples[i].prompt for i in rollouts.prompt_index]
reward, failures = rewards.safe_rewards(digit_share, prompts, completions)
advantages = np.asarray(grpo.get_advantage_estimator("grpo")(jnp.asarray(reward), SAMPLES))

learner = Learner(model_cfg, LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), micro_batch_size=8,
                                           temperature=sp.temperature, remat=False), mesh)
state = learner.init_state(params)
seq_len = 24 + MAX_TOKENS
batch, packing = loop.build_batch(prompt_ids, rollouts, advantages, seq_len, tokenizer.pad_token_id,
                                  minibatch_rows=learner.minibatch_rows)
rows = (batch["tokens"], batch["positions"], batch["segment_ids"])
batch["old_logp"] = np.asarray(learner.logprobs(state.params, *rows))
state, updates = learner.update(state, batch)
new_logp = np.asarray(learner.logprobs(state.params, *rows))
print({k: float(v) for k, v in updates[0].items()})

# Change of each answer's log-probability, summed over its tokens.
change = loop.unpack_samples(packing, np.where(batch["loss_mask"], new_logp - batch["old_logp"], 0.0),
                             seq_len).sum(1)
plt.figure(figsize=(5, 3.5))
plt.scatter(advantages, change, s=12)
plt.axhline(0, color="0.5", lw=0.8)
plt.axvline(0, color="0.5", lw=0.8)
plt.xlabel("GRPO advantage of the answer")
plt.ylabel("change of its log-probability")
plt.title(f"one GRPO step: correlation {np.corrcoef(advantages, change)[0, 1]:.2f}")
plt.show()

# %% [markdown]
# ## Save it back, and reload
#
# `save_hf` writes a directory that transformers loads as it is (written to a temporary directory and renamed
# into place, so a crash never leaves half a checkpoint). Reloaded both ways: transformers' forward matches ours
# for the trained weights, and `load_hf` gives back exactly the arrays that were saved.

# %%
OUT_DIR = os.path.join(WORK_DIR, "after_one_grpo_step")
trained = jax.device_get(state.params)
hf_io.save_hf(OUT_DIR, model_cfg, trained, tokenizer=tokenizer)
print(sorted(os.listdir(OUT_DIR)))

reloaded = transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR, dtype=torch.float32).eval()
difference = np.abs(torch_logits(reloaded, probe) - our_logits(trained, probe)).max()
print(f"transformers on the saved checkpoint vs tlt_jax: max |logit difference| {difference:.2e}")
np.testing.assert_allclose(torch_logits(reloaded, probe), our_logits(trained, probe), atol=1e-4)

config_again, params_again = hf_io.load_hf(OUT_DIR)
assert config_again == model_cfg
jax.tree.map(np.testing.assert_array_equal, params_again, trained)
print("load_hf(save_hf(params)) == params: exact")
