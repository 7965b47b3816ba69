# %% [markdown]
# # Speculative decoding: a target, its drafter, and the same distribution
#
# The rollout engine decodes plainly (one token per sequence per target forward) or speculatively: a small
# drafter proposes a chain or a tree of tokens and the target verifies them all in one forward, keeping the
# longest prefix that lossless rejection sampling accepts plus one token of its own. Accepted tokens are free
# target steps; because verification is lossless, the answers follow exactly the target's distribution at any
# temperature, so RL learns the same thing either way.
#
# This notebook loads the shipped target (`assets/sft_tiny`, a 0.8M-parameter model trained on addition traces)
# and its EAGLE-style drafter (`assets/drafter_tiny`: one decoder layer that reads the target's last hidden state
# and the next token's embedding, reusing the target's embedding and LM head), then
#
# 1. generates plainly and speculatively and compares answers, throughput and acceptance length;
# 2. measures the acceptance length of several drafting strategies (EAGLE chains and trees, a model-free n-gram
#    drafter);
# 3. checks empirically that plain and speculative sampling draw from the same distribution.

# %%
import os

import jax

# TLT_NOTEBOOK_SMOKE=1 shrinks everything to seconds (what the tests execute).
SMOKE = os.environ.get("TLT_NOTEBOOK_SMOKE") == "1"
ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
RUNS = os.environ.get("TLT_NOTEBOOK_RUNS", "runs/colab")
# A rerun skips its compiles; the cache the launchers use (JAX_COMPILATION_CACHE_DIR) where one is set.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(RUNS, "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

TARGET, DRAFTER = "assets/sft_tiny", "assets/drafter_tiny"
TEMPERATURE = 1.0  # the RL rollout temperature; speculation is lossless at any temperature
MAX_TOKENS = 96
if SMOKE:
    SLOTS, NUM_PROMPTS, DIST_SAMPLES = 16, 8, 256
    # the distribution test's samples a generate call at a time: each call fills every slot once, so its
    # prefills take one shape (one call of them all refills slots as they free, in batches of each size)
    DIST_PER_CALL = SLOTS
    STRATEGIES = ["eagle-d4", "ngram-d4-b2"]
    KV_BUCKET = 0  # attention over every cache slot: one compiled program per strategy
else:
    SLOTS, NUM_PROMPTS, DIST_SAMPLES = (64, 64, 8192) if ACCELERATOR else (32, 32, 2048)
    STRATEGIES = ["eagle-d4", "eagle-d3", "eagle-d6", "eagle-d5-k3-t16", "ngram-d4-b2"]
    DIST_PER_CALL = DIST_SAMPLES  # one generate call: continuous batching refills slots as they free
    KV_BUCKET = 64  # attention reads the smallest of 64, 128, ... cache slots that holds every sequence
print(f"backend {jax.default_backend()}: {SLOTS} slots, {NUM_PROMPTS} prompts, strategies {STRATEGIES}")

# %% [markdown]
# ## The target, the drafter and the engine
#
# Strategies are named by how they draft: `eagle-d4` a chain of 4 drafted tokens, `eagle-d5-k3-t16` an EAGLE-2
# tree 5 levels deep expanding the 3 best nodes per level and verifying the best 16, `ngram-d4-b2` up to 2
# continuations of 4 tokens matched in the sequence so far (no drafter model).

# %%
import time

import numpy as np

from configs.common import tasks_tiny
from tlt_jax import evaluation, rewards, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.drafter_training.io import load_drafter
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.speculative import FixedSpeculation, Strategy
from tlt_jax.rollout.timeline import RolloutTimeline, SpecChunk
from tlt_jax.tokenizer import load_tokenizer

model_cfg, params = load_hf(TARGET)
tokenizer = load_tokenizer(TARGET)
drafter_cfg, drafter_params = load_drafter(DRAFTER, model_cfg)
drafter_size = sum(x.size for x in jax.tree.leaves(drafter_params))
print(f"target: {model_cfg.num_params() / 1e6:.2f}M parameters, {model_cfg.num_layers} layers; "
      f"drafter: {drafter_cfg.num_layers} layer, {drafter_size / 1e6:.2f}M parameters of its own")

strategies = [Strategy.from_name(name) for name in STRATEGIES]
engine = RolloutEngine(
    model_cfg, params, sharding.make_mesh({"data": 1}, jax.devices()[:1]),
    RolloutConfig(num_slots=SLOTS, max_prompt_length=24, max_length=24 + MAX_TOKENS, kv_bucket=KV_BUCKET,
                  eos_token_id=model_cfg.eos_token_id, max_draft_depth=max(s.depth for s in strategies)),
    drafter_cfg, drafter_params)
sp = sampling.SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS)
examples = tasks.make_split(tasks.from_spec(tasks_tiny().to_dict()), "eval", NUM_PROMPTS, seed=2,
                            unique=True)
prompts = evaluation.encode_prompts(tokenizer, examples)


def timed_generate(speculation):
    """One answer per prompt; the first call compiles, the second is timed."""
    key = jax.random.PRNGKey(0)
    engine.generate(prompts, 1, sp, key, speculation=speculation)
    t0 = time.perf_counter()
    out = engine.generate(prompts, 1, sp, key, speculation=speculation)
    seconds = time.perf_counter() - t0
    completions = evaluation.decode_completions(tokenizer, out.tokens)
    correct = rewards.answer_correctness([e.prompt for e in examples], completions,
                                         **tasks.reward_fields(examples))
    return dict(out=out, completions=completions, accuracy=float(np.mean(correct)),
                tokens_per_s=int(out.lengths.sum()) / seconds,
                acceptance_length=out.timeline.summary()["acceptance_length"])

# %% [markdown]
# ## Plain and speculative generation
#
# Every decode step is speculative here (`FixedSpeculation` with a threshold of all slots); in RL the tuner
# decides per chunk. At temperature > 0 the two runs draw different samples from the same distribution.

# %%
plain = timed_generate(None)
speculative = timed_generate(FixedSpeculation(strategies[0], max_active=SLOTS))
print(f"{'plain':>12}: {plain['tokens_per_s']:7.0f} tokens/s, accuracy {plain['accuracy']:.2f}")
print(f"{strategies[0].name:>12}: {speculative['tokens_per_s']:7.0f} tokens/s, accuracy {speculative['accuracy']:.2f}, "
      f"acceptance length {speculative['acceptance_length']:.2f}")
for e, a, b in list(zip(examples, plain["completions"], speculative["completions"]))[:3]:
    print(f"\n{e.prompt.strip()}   (answer {e.answer})\n  plain:       {a!r}\n  speculative: {b!r}")

# %% [markdown]
# ## Acceptance length per strategy
#
# Acceptance length: tokens committed per sequence per verify step, the bonus token included (1.0 means every
# draft was rejected). Throughput is the whole generate call against plain decode at the same batch. On a CPU a
# step costs per-operation overhead more than memory traffic, so these speed-ups say little about a GPU, where
# speculation pays in the memory-bound long tail (few sequences, a large target). `docs/benchmarks.md` has the
# CPU measurements at every batch size (`experiments/bench_spec.py`).

# %%
import matplotlib.pyplot as plt

results = {strategies[0].name: speculative}
for strategy in strategies[1:]:
    results[strategy.name] = timed_generate(FixedSpeculation(strategy, max_active=SLOTS))

names = list(results)
fig, (ax_acc, ax_speed, ax_hist) = plt.subplots(1, 3, figsize=(14, 3.8))
ax_acc.bar(names, [results[n]["acceptance_length"] for n in names], color="C0")
ax_acc.axhline(1.0, color="0.5", lw=0.8)
ax_acc.set_ylabel("acceptance length")
ax_speed.bar(names, [results[n]["tokens_per_s"] / plain["tokens_per_s"] for n in names], color="C1")
ax_speed.axhline(1.0, color="0.5", lw=0.8)
ax_speed.set_ylabel(f"tokens/s vs plain ({plain['tokens_per_s']:.0f}/s)")
for ax in (ax_acc, ax_speed):
    ax.tick_params(axis="x", rotation=30)
committed = [n for c in speculative["out"].timeline.groups[0].chunks if isinstance(c, SpecChunk)
             for n in c.committed_per_sequence]
ax_hist.hist(committed, bins=np.arange(0.5, strategies[0].depth + 2), rwidth=0.8, color="C2")
ax_hist.set_xlabel(f"tokens committed per verify step ({strategies[0].name})")
ax_hist.set_ylabel("sequence-steps")
fig.suptitle(f"batch of {SLOTS} slots, temperature {TEMPERATURE}, every step speculative")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Same distribution: plain against speculative samples
#
# Many answers to one prompt, sampled plainly and speculatively with independent keys. The tiny model is unsure
# at temperature 1, so its final answers spread over many values. A chi-square test of homogeneity on the
# answers' counts (rare answers pooled, so that every cell expects at least 5) asks whether the two samples could
# come from one distribution: a large p-value is what losslessness predicts; a sampler bug would show as a tiny
# one once there are enough samples.

# %%
from scipy import stats

PROMPT = "add 57+38\n"
ids = tokenizer(PROMPT)["input_ids"]


def draw(key, speculation=None):
    """DIST_SAMPLES answers to PROMPT, DIST_PER_CALL per generate call: the answers' tokens and the calls'
    timeline."""
    outs = [engine.generate([ids], DIST_PER_CALL, sp, k, speculation=speculation)
            for k in jax.random.split(key, DIST_SAMPLES // DIST_PER_CALL)]
    return [t for out in outs for t in out.tokens], RolloutTimeline([g for out in outs for g in out.timeline.groups])


draws = {"plain": draw(jax.random.PRNGKey(1)),
         "speculative": draw(jax.random.PRNGKey(2), FixedSpeculation(strategies[0], max_active=SLOTS))}
answers = {mode: [rewards.parse_answer(c) or "(none)" for c in evaluation.decode_completions(tokenizer, tokens)]
           for mode, (tokens, _) in draws.items()}
values, pooled = np.unique(answers["plain"] + answers["speculative"], return_counts=True)
kept = [v for v, n in sorted(zip(values, pooled), key=lambda x: -x[1]) if n >= 10]
categories = kept + ["other"]
counts = np.array([[sum(a == v for a in answers[mode]) for v in kept] for mode in draws])
counts = np.concatenate([counts, DIST_SAMPLES - counts.sum(1, keepdims=True)], 1)
if counts[:, -1].sum() < 10:  # too few pooled answers to form a cell of their own
    counts, categories = counts[:, :-1], categories[:-1]
test = stats.chi2_contingency(counts)
print(f"{DIST_SAMPLES} samples each; speculative acceptance length "
      f"{draws['speculative'][1].summary()['acceptance_length']:.2f}; chi-square {test.statistic:.1f} "
      f"on {test.dof} degrees of freedom, p-value {test.pvalue:.3f}")

x = np.arange(len(categories))
plt.figure(figsize=(max(6, 0.6 * len(categories)), 3.5))
plt.bar(x - 0.2, counts[0] / DIST_SAMPLES, width=0.4, label="plain")
plt.bar(x + 0.2, counts[1] / DIST_SAMPLES, width=0.4, label=f"speculative ({strategies[0].name})")
plt.xticks(x, categories, rotation=45)
plt.xlabel(f"final answer to {PROMPT.strip()!r} (correct: {57 + 38})")
plt.ylabel("share of samples")
plt.title(f"temperature {TEMPERATURE}: chi-square p-value {test.pvalue:.3f}")
plt.legend()
plt.show()
