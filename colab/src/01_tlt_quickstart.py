# %% [markdown]
# # TLT quickstart: GRPO with adaptive speculative rollouts and a drafter trained on the spot
#
# This notebook runs the project's main job (`python -m experiments.train_rl --config=configs/rl.py:tiny`) for a
# few RL steps and looks at what TLT did in it.
#
# - **The job.** GRPO on schoolbook-addition traces with a verifiable reward, warm-started from the small SFT
#   checkpoint shipped in `assets/sft_tiny` and its EAGLE-style drafter `assets/drafter_tiny`.
# - **Adaptive rollouts.** Each rollout chunk, a bucketed epsilon-greedy bandit (BEG-MAB) picks plain decode or a
#   drafting strategy by the number of sequences still running, from measured tokens/s. Verification is lossless,
#   so the sampled answers, and what GRPO learns from them, do not change.
# - **The drafter, trained on the spot.** In the idle gaps of each RL step the drafter trains on the hidden states
#   and top-K distributions that the learner's old-policy pass produces anyway; the engine gets each new version
#   between rollouts.
#
# On this tiny model a drafter step costs a large share of a target step, so speculation rarely pays on a CPU and
# the tuner mostly keeps plain decode: the point here is to see the machinery. On a GPU runtime the job runs at
# its full size.

# %%
import os

import jax

# TLT_NOTEBOOK_SMOKE=1 shrinks everything to seconds (what the tests execute);
# TLT_NOTEBOOK_RUNS says where runs are written.
SMOKE = os.environ.get("TLT_NOTEBOOK_SMOKE") == "1"
ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
RUNS = os.environ.get("TLT_NOTEBOOK_RUNS", "runs/colab")
RUN_DIR = os.path.join(RUNS, "01_tlt_quickstart")
# Compiled programs are cached on disk: the second rollout engine below, and a rerun of the
# notebook, skip the compiles already done; the cache the launchers use (JAX_COMPILATION_CACHE_DIR)
# where one is set.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(RUNS, "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

if SMOKE:
    OVERRIDES = {
        "steps": 3, "eval_every": 3, "checkpoint_every": 3, "tlt.drafter.checkpoint_every": 3,
        "data.num_train": 64, "data.num_eval": 16, "rollout.num_slots": 32, "rollout.max_tokens": 64,
        "prompts_per_step": 4, "num_samples": 8, "learner.micro_batch_size": 16, "learner.num_minibatches": 1,
        "track_kl": False, "rollout.kv_bucket": 0,  # attention over every slot: one program per chunk
        # one bucket of 1-8 running sequences with one drafting strategy beside plain decode
        "tlt.tuner.buckets": [1], "tlt.tuner.arms": [["eagle-d3", "plain"]], "tlt.tuner.max_active": 8,
        # one shape of drafter step and of its scoring (the batch sizes up to these are compiled each)
        "tlt.drafter.batch_size": 1, "tlt.drafter.eval_rows": 1,
    }
elif ACCELERATOR:
    OVERRIDES = {}  # the main job as configured: 60 RL steps
else:
    OVERRIDES = {"steps": 12, "eval_every": 6, "checkpoint_every": 6, "tlt.drafter.checkpoint_every": 6}
print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); overrides: {OVERRIDES}")

# %% [markdown]
# ## The config and the run
#
# `configs/rl.py` holds every knob; the TLT ones live under `config.tlt` (`tuner`: buckets and arms of the bandit,
# `spot`: the idle-gap scheduler, `drafter`: its training). `--config.tlt.enabled=False` would run the same job
# without TLT, the baseline. `train_rl` writes metrics (JSONL, TensorBoard), plots, checkpoints, the policy in
# Hugging Face format (`hf/`) and the trained drafter (`drafter/`) to the run directory; run again on the same
# directory, it resumes.

# %%
import shutil

from configs import rl
from tlt_jax.rl.train import train_rl

config = rl.get_config("tiny")
config.update_from_flattened_dict({**OVERRIDES, "run_dir": RUN_DIR})
shutil.rmtree(RUN_DIR, ignore_errors=True)  # a fresh run: an existing directory would be resumed
print(config.tlt.tuner)

# %%
summary = train_rl(config)
summary

# %% [markdown]
# ## Reward and accuracy
#
# Reward of the sampled answers (mean and spread over the step's samples), the share of correct answers, and
# greedy accuracy on held-out problems (step 0 is the SFT checkpoint).

# %%
from IPython.display import Image, display

display(Image(filename=os.path.join(RUN_DIR, "reward.png")))

# %% [markdown]
# ## What TLT did, step by step
#
# Mean acceptance length of the speculative steps (tokens committed per sequence per verify step, bonus included),
# the share of rollout tokens committed speculatively, rollout throughput, the drafter version the engine used
# (one new version per RL step), and the drafter steps run on the spot in idle gaps.

# %%
display(Image(filename=os.path.join(RUN_DIR, "tlt.png")))

# %% [markdown]
# The tuner's choices: per bucket of active batch size, each arm's share of the bucket's pulls at each RL step
# (plain decode is an arm, so speculation has to beat it on measured throughput).

# %%
display(Image(filename=os.path.join(RUN_DIR, "tuner_arms.png")))

# %% [markdown]
# ## One rollout with the trained policy, drafter and tuner
#
# The run exported the policy (`hf/`) and the drafter trained on the spot (`drafter/`), a free by-product usable
# for inference; its last checkpoint holds the tuner's statistics. One more rollout with all three shows the long
# tail: many sequences decode plainly, and once few are left the tuner may switch to a drafting strategy.

# %%
import numpy as np

from tlt_jax import checkpoint, evaluation, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.drafter_training.io import load_drafter
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout import tuner as tuner_lib
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.timeline import SpecChunk
from tlt_jax.tokenizer import load_tokenizer

model_cfg, params = load_hf(os.path.join(RUN_DIR, "hf"))
tokenizer = load_tokenizer(os.path.join(RUN_DIR, "hf"))
drafter_cfg, drafter_params = load_drafter(os.path.join(RUN_DIR, "drafter"), model_cfg)
tuner = tuner_lib.from_config(config.tlt.tuner)
with checkpoint.Checkpointer(os.path.join(RUN_DIR, "checkpoints")) as ckpt:
    tuner.load_state_dict(ckpt.read_meta(ckpt.latest_step())["tlt"]["tuner"])

r = config.rollout
engine = RolloutEngine(
    model_cfg, params, sharding.make_mesh({"data": 1}, jax.devices()[:1]),
    RolloutConfig(num_slots=r.num_slots, max_prompt_length=r.max_prompt_length,
                  max_length=r.max_prompt_length + r.max_tokens, steps_per_sync=r.steps_per_sync,
                  spec_steps_per_sync=r.spec_steps_per_sync, kv_bucket=r.kv_bucket, eos_token_id=model_cfg.eos_token_id,
                  max_draft_depth=max(s.depth for s in tuner.strategies)),
    drafter_cfg, drafter_params)
sp = sampling.SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
print(f"compiled plain decode and {len(tuner.strategies)} strategies in {engine.warm_up(sp, tuner):.1f} s")
examples = tasks.make_split(tasks.from_spec(config.data.tasks.to_dict()), "eval", config.prompts_per_step, seed=7)
rollouts = engine.generate(evaluation.encode_prompts(tokenizer, examples), config.num_samples, sp,
                           jax.random.PRNGKey(1), speculation=tuner)
rollouts.timeline.summary()

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

group = rollouts.timeline.groups[0]
chunks = [c for c in group.chunks if c.active_per_step]
fig, (ax_active, ax_tokens) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
colors = {"plain": "0.6"}
for chunk in chunks:
    label = chunk.strategy if isinstance(chunk, SpecChunk) else "plain"
    color = colors.setdefault(label, f"C{len(colors)}")
    n = len(chunk.active_per_step)
    width = (chunk.end - chunk.start) / n
    t = chunk.start - chunks[0].start + (np.arange(n) + 0.5) * width
    active = np.asarray(chunk.active_per_step)
    ax_active.bar(t, active, width=width, color=color)
    ax_tokens.bar(t, np.asarray(chunk.tokens_per_step) / np.maximum(active, 1), width=width, color=color)
ax_active.legend(handles=[Patch(color=c, label=name) for name, c in colors.items()], title="decode steps",
                 loc="upper right")
ax_active.set_ylabel("active sequences")
ax_active.set_title(f"one rollout of {len(rollouts)} answers ({config.prompts_per_step} prompts x "
                    f"{config.num_samples}): the long tail")
ax_tokens.set_ylabel("tokens per sequence\nper step")
ax_tokens.set_xlabel("seconds since the first decode step")
plt.show()

# %% [markdown]
# The same long tail as a histogram of answer lengths: most answers end early, a few run long, and while they
# run the devices that finished their share would idle. That is where TLT speculates and trains the drafter.

# %%
lengths = rollouts.lengths
plt.figure(figsize=(7, 3))
plt.hist(lengths, bins=min(40, len(set(lengths.tolist()))), color="C0")
plt.axvline(np.percentile(lengths, 50), color="C2", ls="--", label=f"median {np.percentile(lengths, 50):.0f}")
plt.axvline(lengths.max(), color="C3", ls="--", label=f"max {lengths.max()}")
plt.xlabel("answer length (tokens)")
plt.ylabel("answers")
plt.legend()
plt.show()
