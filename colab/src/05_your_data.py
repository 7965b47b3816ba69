# %% [markdown]
# # Your model, your data, your reward
#
# GRPO with TLT on a Hugging Face checkpoint, a dataset file and a verifier of your own (docs/your_model.md).
# Nothing is downloaded: this notebook makes a small Qwen2 checkpoint the way a user brings one (a byte-level
# BPE tokenizer trained on reasoning-gym text, Qwen2.5-Instruct's chat template and its two end tokens), then
#
# 1. SFT teaches it the `<answer>...</answer>` format on reasoning-gym tasks (`data.source=reasoning_gym:...`);
# 2. writes a parquet file of problems, as a GSM8K or verl file would be;
# 3. runs a few GRPO steps with TLT on, from that file, in the chat template, scored by a reward defined here;
# 4. shows what the run wrote: the templated prompts, completions and rewards of `eval_samples.jsonl`.
#
# With your own checkpoint, set `MODEL_DIR` to its directory and skip the first two steps; with your own data,
# point `data.train` / `data.eval` at your files and name their columns (`data.prompt_field`,
# `data.answer_field`). It needs the `envs` extra (`pip install -e '.[envs]'`) for reasoning-gym.

# %%
import os

import jax

# TLT_NOTEBOOK_SMOKE=1 shrinks everything to seconds (what the tests execute).
SMOKE = os.environ.get("TLT_NOTEBOOK_SMOKE") == "1"
RUNS = os.environ.get("TLT_NOTEBOOK_RUNS", "runs/colab")
WORK_DIR = os.path.join(RUNS, "05_your_data")
# A rerun skips its compiles; the cache the launchers use (JAX_COMPILATION_CACHE_DIR) where one is set.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(RUNS, "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
TASKS = "reasoning_gym:basic_arithmetic,chain_sum,leg_counting"
SFT_STEPS, RL_STEPS = (5, 2) if SMOKE else (300, 6)
print(f"backend {jax.default_backend()}; SFT {SFT_STEPS} steps, RL {RL_STEPS} steps")

# %% [markdown]
# ## A checkpoint as a user brings one
#
# `experiments.make_example_model` trains the tokenizer and writes a Qwen2 checkpoint with random weights through
# transformers: `config.json` names `<|im_end|>` as its end token, `generation_config.json` both `<|im_end|>` and
# `<|endoftext|>`. The engine stops on either.

# %%
import shutil

from experiments.make_example_model import write_example_model
from tlt_jax.models.hf_io import load_hf_config
from tlt_jax.tokenizer import load_tokenizer

shutil.rmtree(WORK_DIR, ignore_errors=True)
BASE_DIR = write_example_model(os.path.join(WORK_DIR, "base"), hidden_size=32 if SMOKE else 64,
                               num_layers=2 if SMOKE else 4)
tokenizer = load_tokenizer(BASE_DIR)
print(sorted(os.listdir(BASE_DIR)))
print("end tokens:", [tokenizer.convert_ids_to_tokens(i) for i in load_hf_config(BASE_DIR).end_token_ids])
print(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                    tokenize=False))

# %% [markdown]
# ## SFT on reasoning-gym tasks
#
# `configs/sft.py:example` starts from `model_dir` and trains on the answers of the reasoning-gym tasks, each after
# its prompt in the chat template and ending on the end of turn.

# %%
from configs import sft as sft_configs
from tlt_jax.sft import train_sft

c = sft_configs.get_config("example")
c.model_dir, c.run_dir = BASE_DIR, os.path.join(WORK_DIR, "sft")
c.data.update(source=TASKS, num_train=256 if SMOKE else 2000, num_eval=16 if SMOKE else 64)
c.update(steps=SFT_STEPS, eval_every=SFT_STEPS, checkpoint_every=SFT_STEPS)
c.mesh.data = jax.device_count()
sft_result = train_sft(c)
MODEL_DIR = os.path.join(c.run_dir, "hf")
sft_result

# %% [markdown]
# ## A dataset file and a reward of your own
#
# Any JSONL, JSON, Parquet or CSV file works, or a `save_to_disk` directory; nested columns are named by dotted
# paths. Here: reasoning-gym problems written as rows with a `question` and an `answer`, and a verifier, a plain
# function `fn(prompts, completions, **fields) -> list[float]` (TRL's and tunix's convention), given to the run by
# its import path (`__main__:tagged_answer` names this notebook's).

# %%
import datasets

from tlt_jax.data import reasoning_gym_problems


def rows(split, n):
    return [{"question": e.prompt, "answer": e.answer, "task": e.task}
            for e in reasoning_gym_problems.make_split(TASKS, split, n, seed=7, unique=split == "eval")]


TRAIN_FILE, EVAL_FILE = os.path.join(WORK_DIR, "train.parquet"), os.path.join(WORK_DIR, "eval.parquet")
datasets.Dataset.from_list(rows("train", 200)).to_parquet(TRAIN_FILE)
datasets.Dataset.from_list(rows("eval", 16 if SMOKE else 32)).to_parquet(EVAL_FILE)


def tagged_answer(prompts, completions, answer, **fields):
    """1 for the reference inside <answer>...</answer>, 0.1 for the tags around something else."""
    from reasoning_gym.utils import extract_answer

    scores = []
    for completion, reference in zip(completions, answer):
        given = extract_answer(completion)
        scores.append(0.0 if given is None else 1.0 if given.strip() == reference.strip() else 0.1)
    return scores


datasets.load_dataset("parquet", data_files=TRAIN_FILE, split="train")

# %% [markdown]
# ## GRPO with TLT on the file
#
# `configs/rl.py:hf` is the preset for your checkpoint: the chat template, TLT at the reference's defaults
# (speculation while at most 32 sequences run, buckets 1/2/5/21, epsilon 0.1) and a drafter trained from scratch on
# the spot. Prompts longer than `rollout.max_prompt_length` would be dropped and counted.

# %%
from configs import rl as rl_configs
from tlt_jax.rl.train import train_rl

c = rl_configs.get_config("hf")
c.model_dir, c.run_dir = MODEL_DIR, os.path.join(WORK_DIR, "rl")
c.data.update(train=TRAIN_FILE, eval=EVAL_FILE, prompt_field="question", answer_field="answer")
c.reward = "__main__:tagged_answer"
c.rollout.update(max_prompt_length=128, max_tokens=24, num_slots=32)
c.update(steps=RL_STEPS, eval_every=RL_STEPS, checkpoint_every=RL_STEPS, prompts_per_step=4, num_samples=4)
c.tlt.drafter.seq_len = 160
if SMOKE:  # one bucket with one drafting strategy beside plain decode, one attention bucket: a few programs
    c.tlt.tuner.update(buckets=[1], arms=[["eagle-d3", "plain"]], max_active=8)
    c.rollout.kv_bucket = 0
    c.tlt.drafter.update(batch_size=1, eval_rows=1)  # one shape of drafter step and of its scoring
c.mesh.data = jax.device_count()
summary = train_rl(c)
{k: summary[k] for k in ("sft_eval_accuracy", "final_eval_accuracy", "final_eval_truncated_share",
                         "dropped_prompts")}

# %% [markdown]
# ## What the run wrote
#
# `eval_samples.jsonl` holds every evaluated sample: the prompt as the chat template made it, the completion, the
# reference, the reward, the length and whether it ended on an end token. The plots are PNGs in the run directory.

# %%
import pandas as pd
from IPython.display import Image, display

samples = pd.read_json(os.path.join(c.run_dir, "eval_samples.jsonl"), lines=True)
print(samples["prompt"].iloc[0])
display(samples[["step", "completion", "reference", "reward", "length", "ended"]].tail(8))
display(Image(os.path.join(c.run_dir, "reward.png")))
