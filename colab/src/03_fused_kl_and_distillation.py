# %% [markdown]
# # Fused KL and distillation from a top-K teacher cache
#
# Distillation here follows two ideas:
#
# - **A top-K teacher cache.** The teacher runs once over the dataset; for every position the cache keeps its K
#   most likely next tokens and their full-vocabulary log-probs, on disk as tensorstore (zarr v3) arrays. The
#   student trains from the cache; the teacher is not needed again.
# - **A fused loss.** The student's loss, sum over the cached support S of p (log p - log q), needs q = softmax of
#   the student's logits over the whole vocabulary. The fused kernel projects a block of positions at a time
#   through the LM head, folds the block into the loss and its gradient and discards the logits, so memory never
#   holds [tokens, vocabulary] logits. The same kernel trains the TLT drafter and gives GRPO its per-token
#   log-probs (K = 1).
#
# The notebook distills a small student from the shipped SFT model (`assets/sft_tiny`), looks inside the cache,
# and measures the memory of the dense and the fused loss as the number of tokens N grows, at the shape of a
# Llama-3.2-3B LM head.

# %%
import os

import jax

# TLT_NOTEBOOK_SMOKE=1 shrinks everything to seconds (what the tests execute).
SMOKE = os.environ.get("TLT_NOTEBOOK_SMOKE") == "1"
ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
RUNS = os.environ.get("TLT_NOTEBOOK_RUNS", "runs/colab")
RUN_DIR = os.path.join(RUNS, "03_distill")
# A rerun skips its compiles; the cache the launchers use (JAX_COMPILATION_CACHE_DIR) where one is set.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(RUNS, "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

if SMOKE:
    OVERRIDES = {"steps": 8, "eval_every": 8, "checkpoint_every": 8, "batch_size": 8, "eval_batch_size": 8,
                 "cache_batch_size": 8, "data.num_train": 64, "data.num_eval": 16,
                 "student.hidden_size": 32, "student.intermediate_size": 64, "student.num_layers": 1,
                 "student.num_heads": 2, "student.num_kv_heads": 1, "optimizer.warmup_steps": 0,
                 "optimizer.learning_rate": 1e-2}
    TOKENS = [4096, 65536, 262144]
elif ACCELERATOR:
    OVERRIDES = {}  # configs/distill.py:tiny as it is: 600 steps
    TOKENS = [1024, 4096, 16384, 65536, 262144]
else:
    OVERRIDES = {"steps": 200, "eval_every": 50, "checkpoint_every": 200, "data.num_train": 2000,
                 "data.num_eval": 128, "optimizer.decay_steps": 200}
    TOKENS = [1024, 4096, 16384, 65536, 262144]
print(f"backend {jax.default_backend()}; overrides {OVERRIDES}")

# %% [markdown]
# ## Distill: teacher cache first, then the student
#
# `configs/distill.py:tiny` (the launcher is `python -m experiments.distill`): K = 8 of the 37-token vocabulary,
# a student smaller than the teacher. `mode="offline"` (the default) writes the cache under the run directory and
# trains from it; run again, the job finds the finished cache and does not run the teacher.

# %%
import shutil

from configs import distill
from tlt_jax.distill.train import train_distill

config = distill.get_config("tiny")
config.update_from_flattened_dict({**OVERRIDES, "run_dir": RUN_DIR})
shutil.rmtree(RUN_DIR, ignore_errors=True)  # a fresh run: an existing directory would be resumed
summary = train_distill(config)
{k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}

# %% [markdown]
# Training loss (the top-K objective, which can be negative since the cached mass is below 1), gradient norm,
# and on held-out rows the exact KL from teacher to student and how often their most likely tokens agree.

# %%
from IPython.display import Image, display

display(Image(filename=os.path.join(RUN_DIR, "distill_curves.png")))

# %% [markdown]
# ## Inside the teacher cache
#
# The cache records what it was made from (fingerprints of the teacher's weights, the tokenizer and the token
# dataset, K, temperature, dtype); a reader expecting anything else is refused with the differing fields named.
# Below: the packed rows are rebuilt from the config and matched against the cache's dataset fingerprint, then
# one row's cached top-K is read back.

# %%
import numpy as np

from tlt_jax import fingerprint
from tlt_jax.data import tasks
from tlt_jax.data.packing import pack_examples
from tlt_jax.distill import teacher_cache as tc
from tlt_jax.tokenizer import load_tokenizer

cache_path = os.path.join(RUN_DIR, "teacher_cache", "train")
meta = tc.read_cache_meta(cache_path)
reader = tc.TeacherCacheReader(cache_path, meta)
print(meta)
print("on disk:", sorted(os.listdir(cache_path)), "|", reader.num_sequences, "rows of", reader.seq_len, "tokens")

tokenizer = load_tokenizer(config.teacher_dir)
task = tasks.from_spec(config.data.tasks.to_dict())
rows = pack_examples(tokenizer, tasks.make_split(task, "train", config.data.num_train, config.seed),
                     config.data.seq_len)
assert fingerprint.fingerprint_tokens(rows["tokens"]) == meta.dataset_fingerprint  # the cache was made from these rows
ids_NTK, logp_NTK = reader.read(np.arange(min(16, reader.num_sequences)))
print("ids", ids_NTK.shape, ids_NTK.dtype, "| logp", logp_NTK.shape, logp_NTK.dtype)

# %%
import matplotlib.pyplot as plt

# The positions that predict one example's solution (where the teacher was trained): of the examples in the
# rows read above, the one where the teacher is least sure of its top token.
segments = [(row, rows["segment_ids"][row] == segment) for row in range(len(ids_NTK))
            for segment in range(1, rows["segment_ids"][row].max() + 1)]
row, in_segment = max(segments, key=lambda s: np.mean(
    1 - np.exp(logp_NTK[s[0], np.flatnonzero(rows["mask"][s[0]] & s[1][:-1]), 0].astype(np.float32))))
at = np.flatnonzero(rows["mask"][row] & in_segment[:-1])
p_TK = np.exp(logp_NTK[row, at].astype(np.float32))
labels = [tokenizer.decode([t]).replace("\n", "\\n").replace(" ", "\u2423") for t in rows["tokens"][row, at + 1]]
x = np.arange(len(at))
plt.figure(figsize=(max(7, 0.3 * len(at)), 3.5))
plt.bar(x, p_TK[:, 0], color="C0", label="top-1")
plt.bar(x, p_TK[:, 1:].sum(1), bottom=p_TK[:, 0], color="C1", label=f"top-2..{meta.top_k}")
plt.bar(x, 1 - p_TK.sum(1), bottom=p_TK.sum(1), color="0.8", label="outside the top-K")
plt.xticks(x, labels)
plt.xlabel("next token of the trace")
plt.ylabel("teacher probability")
prompt = tokenizer.decode(rows["tokens"][row, np.argmax(in_segment):at[0] + 1], skip_special_tokens=True)
plt.title(f"{prompt.strip()!r}: the teacher's cached top-{meta.top_k}")
plt.legend(loc="lower right", fontsize="small")
plt.show()

# %% [markdown]
# ## Memory of the loss as N grows: dense against fused
#
# XLA decides every buffer at compile time, so `jax.jit(f).lower(*abstract inputs).compile().memory_analysis()`
# reports the temporary memory of any shape on any backend without allocating it. Below: forward and backward of
# the top-K KL with respect to the hidden states and the LM head, at the Llama-3.2-3B head (D = 3072,
# V = 128256, bfloat16) with K = 100 as in the paper's benchmark. The dense loss materialises [N, V] float32
# logits and grows with N V; the fused one grows only by buffers the size of the hidden states (N D). Numbers
# are this backend's compiler's; a GPU's differ in detail (`docs/benchmarks.md` has measured ones).

# %%
import jax.numpy as jnp

from tlt_jax import losses

D, V, K = 3072, 128256, 100
GIB = 2**30


def temp_gib(impl: str, n: int) -> float:
    """XLA's temporary memory for loss and gradients of n tokens, from the compiled program."""
    def loss(h_ND, w_DV, ids_NK, logp_NK):
        return losses.linear_topk_kl(h_ND, w_DV, ids_NK, logp_NK, reduction="mean", impl=impl)

    shapes = (jax.ShapeDtypeStruct((n, D), jnp.bfloat16), jax.ShapeDtypeStruct((D, V), jnp.bfloat16),
              jax.ShapeDtypeStruct((n, K), jnp.int32), jax.ShapeDtypeStruct((n, K), jnp.float32))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes / GIB


fused = losses.resolve_impl("auto")
memory = {impl: [temp_gib(impl, n) for n in TOKENS] for impl in ("dense", fused)}
for n, dense_gib, fused_gib in zip(TOKENS, *memory.values()):
    print(f"N = {n:>7}: dense {dense_gib:8.2f} GiB, fused ({fused}) {fused_gib:6.2f} GiB")

plt.figure(figsize=(7, 4))
plt.plot(TOKENS, memory["dense"], "o-", label="dense: [N, V] logits")
plt.plot(TOKENS, memory[fused], "o-", label=f"fused ({fused}): blockwise")
plt.axhline(141e9 / GIB, color="C3", ls="--", lw=1, label="H200 memory (141 GB)")
plt.xscale("log", base=2)
plt.yscale("log")
plt.xlabel("tokens N")
plt.ylabel("XLA temporary memory (GiB)")
plt.title(f"top-K KL, forward + backward: D={D}, V={V}, K={K}, bfloat16 ({jax.default_backend()})")
plt.legend()
plt.show()
