r"""TLT end to end: the same RL run with TLT off (the baseline) and on, each in a fresh process.

  python -m experiments.bench_tlt --preset=cpu_long --seed=0 --out=docs/results/bench_tlt_cpu_long_s0.json
  python -m experiments.bench_tlt --preset=gpu --target=... --drafter=... --out=...   # device_check.sh

Same config, seed and data in every mode; only `tlt.*` differs. Modes:
  baseline   --config.tlt.enabled=False: plain rollouts, no drafter
  tlt        adaptive speculation (the tuner) and the drafter trained on the spot
  frozen     TLT with the warm-start drafter never trained: what a
             static drafter accepts as the policy moves
  scratch    TLT with a drafter from nothing (tlt.drafter.init=''), trained on the spot
  ngram      TLT with n-gram arms only: no drafter at all
  history    TLT with the n-gram arms searching each prompt's earlier rollouts too
             (`history-*` arms in their place), no EAGLE arm

A CPU preset's target is its SFT model (`cpu`, `cpu_tail`: the shipped one; `cpu_long`, the
default: `configs/sft.py:long_tail`, trained once with its drafter) deepened to `layers`
layers by appending layers with zero output projections (`transformer.append_identity_layers`):
the function (and so the accuracy and the drafter's features) of the trained model, the
decode cost of a deeper one, so that a one-layer drafter step is a small fraction of a
target step, as on a GPU. Built once into `--cache_dir`. The wide and drift presets decode
it with every MLP padded to 3x this machine's last-level cache (`machine.py`); every CPU
preset's result records the machine and a regime check (`machine`, `regime`: decode step
at batch 1, 2 and 4 within 15% of each other, a step bound by reading the weights).

Drift (docs/tlt.md): every mode logs `policy_kl_from_start` per step and the TLT modes the
starting drafter's teacher-forced acceptance beside the served one's (per task where a step
has several); `thirds` gives their means over the first and the last third of the steps,
and with `frozen` among the modes `<mode>_versus_frozen` compares each trained drafter with
the frozen one of its pair over the last third (acceptance length, rollout tokens/s).
`--pin_arm` (the drift presets: eagle-d6) pins the drafter modes' tuner to one arm. The
drift presets speculate coupled (`rollout.spec_coupled`): every mode draws the samples plain
decode would, so the policy takes one trajectory whatever the drafter.

Phase times are medians over the steps after `--warmup_steps`; the first steps' excess over
the median is reported as compile time (both modes compile their decode chunks before the
first step, `RolloutEngine.warm_up`; TLT's drafting strategies compile in the step where the
tuner first picks each, a load from the cache once it holds them; compiled programs persist in
`<cache_dir>/xla` across runs). The table gives the phase split of both modes, so a missed
bar shows where the time went. A ratio counts only from a run that compiled nothing new
(`new_compiled_programs` 0 in every mode): on a cold cache, learner and prefill shapes that
first appear in later steps compile inside timed steps, and a later run finds an earlier
run's programs compiled, which flatters it.

Each mode runs in its own fresh process, in ABBA order (`--repeats` pairs: baseline, tlt,
tlt, baseline, ...): in one process the second mode runs faster, whichever it is (warm
allocator, page cache, caches of the first mode's programs). This process builds the
preset's target once (on its CPU, so it never holds an accelerator the runs need), then
starts `python -m experiments.bench_tlt --single_mode=<mode> --out=<part> <the same flags>`
for each run, with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` added to the run's environment on
Linux with transparent huge pages (unless GLIBC_TUNABLES already sets it), and rewrites
`--out` after every run, every run's full result under `runs`. `--print_commands` shows the
runs' command lines and starts nothing; `--repeats=0` runs the modes back to back in this
process as before (its speed-ups, which depend on the order, are named `*_in_process`).

Environment steps (`cpu_wide_env`, `gpu_env`): every sample takes two turns with one step
of a scripted environment between them, sleeping `--env_latency_ms`
(experiments/scripted_env.py); `--noenv_overlap` stops decoding while it sleeps (config
env.overlap). TLT cannot shorten an environment's latency, so `decode_speedup` (the decode
chunks alone, `rollout_split`'s `chunks`) is paired and reported beside the rollout's and
the step's, as every preset's is.

The speed-ups pair the same steps of the two modes (the same prompts): per pair of runs
(the i-th baseline run with the i-th TLT run, by position in the ABBA order) the median over
the timed steps of baseline / TLT per step (`paired_speedups`); `rollout_speedup` and
`step_speedup` are the geometric means of these over the pairs, `*_speedup_min` / `_max`
their range, `pairs` each pair's figures (`decode_speedup` the same over the decode
chunks). `*_speedup_total` (the ratio of the summed times)
and `*_speedup_of_medians` (the ratio of each mode's median time, which can compare unlike
steps: `paired_speedups` says why) are geometric means over the pairs as well. `modes` holds
each mode's first run, `runs` every run ("run", "pair", "mode", "command", "rc", "wall_s",
"cpu_steal", the share of CPU time the hypervisor gave other machines during the run (on
Linux; None elsewhere), and "result", the run's own JSON, or "error", the end of its
stderr), `order` the modes in the order they ran, `child_environment` what the runs'
environment got. Each run's phase medians also split its rollout into decode chunks,
prefill, harvest and the host's other time between chunks (`rollout_split`).
"""
import ast
import dataclasses
import functools
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from configs import rl as rl_configs
from configs.common import tasks_drift_shift
from experiments import machine, scripted_env, slow_reward
from experiments.tlt_bars import first_runs, print_verdicts, read_results, thirds, verdicts
from tlt_jax import fingerprint, launch, metrics
from tlt_jax.drafter_training import io as drafter_io
from tlt_jax.models import transformer as tfm
from tlt_jax.models.hf_io import load_hf, save_hf
from tlt_jax.rl.train import train_rl
from tlt_jax.rollout.timeline import ROLLOUT_PARTS
from tlt_jax.tokenizer import load_tokenizer

_PRESET = flags.DEFINE_enum("preset", "cpu_long", ["cpu", "cpu_long", "cpu_tail", "cpu_wide", "cpu_wide_decode",
                                                   "cpu_wide_tail", "cpu_wide_pair", "cpu_wide_env",
                                                   "cpu_drift_rl", "cpu_drift_shift", "cpu_drift_learn", "cpu_code",
                                                   "cpu_plan", "gpu",
                                                   "gpu_env"],
                            "Run size (see PRESETS).")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the RL runs (data, sampling, drafter).")
OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
STEPS = flags.DEFINE_integer("steps", None, "Override the preset's RL steps per mode.")
_MODES = flags.DEFINE_list("modes", ["baseline", "tlt"], "Modes to run, in order (baseline, tlt, frozen, scratch, "
                           "ngram, history): the order of the first pair of runs; the next pair runs them in "
                           "reverse (ABBA).")
CACHE = flags.DEFINE_string("cache_dir", "runs/bench_tlt_cache", "Where the preset's target and drafter are built.")
_RUN_DIR = flags.DEFINE_string("run_dir", "runs/bench_tlt", "Run directories of the modes go here.")
_TARGET = flags.DEFINE_string("target", "", "A target (Hugging Face checkpoint with tokenizer) in place of the "
                              "preset's deepened SFT model; needs --drafter.")
_DRAFTER = flags.DEFINE_string("drafter", "", "A drafter export for --target (experiments.train_drafter).")
_DECODE_MLP_SIZE = flags.DEFINE_integer("decode_mlp_size", None, "Override the preset's rollout.decode_mlp_size (both "
                                        "modes): decode's MLP width (the wide presets size it from this machine's "
                                        "last-level cache, `machine.mlp_size_for_cache`).")
_PIN_ARM = flags.DEFINE_string("pin_arm", None, "Pin the tuner of the drafter modes (tlt, frozen, scratch) to this "
                               "one arm at every batch (e.g. eagle-d6; '': the preset's arms), so that their live "
                               "acceptance compares drafters, not arm choices.")
_REGIME_CHECK = flags.DEFINE_bool("regime_check", True, "Before the runs of a CPU preset, time the target's padded "
                                  "decode step at batch 1, 2 and 4 (`machine.regime_check`: within 15% of each "
                                  "other where a step is bound by reading the weights, as on a GPU) and record it "
                                  "with the machine.")
_SET = flags.DEFINE_multi_string("set", [], "A config override key=value for every mode, e.g. "
                                 "rollout.kv_bucket=0; repeatable (--tlt_set's apply after it).")
_TLT_SET = flags.DEFINE_multi_string("tlt_set", [], "A config override key=value for the TLT modes (not the "
                                     "baseline), e.g. tlt.tuner.max_active=32 (TLT's threshold); repeatable.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Pairs of runs, each mode in a fresh process, in ABBA order (2: "
                                "baseline, tlt, tlt, baseline); 0: every mode in this process, back to back.")
_SINGLE_MODE = flags.DEFINE_string("single_mode", "", "Run this one mode in this process and write its result to "
                                   "--out (what each run of --repeats is).")
_PRINT_COMMANDS = flags.DEFINE_bool("print_commands", False, "Print the runs' command lines and environment; run "
                                    "nothing.")
_SLOW_REWARD_MS = flags.DEFINE_float("slow_reward_ms", 0.0, "A slow verifier: the task reward after sleeping this "
                                      "many milliseconds per sample (experiments/slow_reward.py); 0: the task reward.")
_REWARD_OVERLAP = flags.DEFINE_bool("reward_overlap", True, "Score each sample as it finishes, while the rest "
                                    "decode (reward_overlap); False: the batch after the rollout.")
_REWARD_WORKERS = flags.DEFINE_integer("reward_workers", 0, "Reward worker processes (0: a scoring thread).")
_ENV_LATENCY_MS = flags.DEFINE_float("env_latency_ms", None, "A preset with environment steps (cpu_wide_env, "
                                     "gpu_env): each step sleeps this many milliseconds (experiments/scripted_env.py); "
                                     "default: the preset's.")
_ENV_OVERLAP = flags.DEFINE_bool("env_overlap", True, "A preset with environment steps: environments step while the "
                                 "other samples decode (env.overlap); False: decoding waits for each step.")
_PLOT_FROM = flags.DEFINE_list("plot_from", [], "Run nothing: draw the drafter modes of these earlier results (JSON "
                               "of --out; a mode's first run among them) in one acceptance plot beside --out, e.g. "
                               "a tlt,frozen pair and a scratch run of the same seed.")
MODES = ("baseline", "tlt", "frozen", "scratch", "ngram", "history")
# The modes with a drafter that `plot_acceptance` draws.
PLOTTED_MODES = ("tlt", "frozen", "scratch", "ngram")
# Flags of this process alone, never passed on to a run.
_PARENT_FLAGS = ("repeats", "single_mode", "print_commands", "out", "modes", "flagfile")

# The warm start's online recipe (the drift presets, with their catch_up_steps=8 and no cap on
# their time, so that a run takes the same drafter steps whatever the machine's load): a
# drafter rate of 3e-4 and the scored publish (tlt.drafter.publish_scored), which keeps a
# faster rate from costing acceptance where nothing drifts (docs/benchmarks.md, "A scored
# publish", has the runs that chose it).
_DRIFT_DRAFTER = dict(batch_size=4, optimizer=dict(learning_rate=3e-4), publish_scored=True)
# A drafter from nothing (mode scratch) learns at the online default's 1e-3, faster than a
# warm start may, and takes 8 catch-up steps an RL step within a tenth of the run's time
# whatever its preset gives the warm start: it has everything to learn (docs/benchmarks.md
# compares step counts). Every version it trains is published: its starting drafter drafts
# nothing worth scoring against.
_SCRATCH = dict(drafter=dict(optimizer=dict(learning_rate=1e-3), publish_scored=False),
                spot=dict(catch_up_steps=8, catch_up_max_share=0.1))

PRESETS = {
    # 16 prompts x 8 samples; traces of up to 8-digit additions (Zipf-distributed digit
    # counts: most short, a few 4x the median), so the batch drains through a long tail.
    "cpu": dict(layers=16, steps=12, warmup_steps=3, prompts_per_step=16, num_samples=8, max_tokens=96,
                num_slots=128, catch_up_steps=2, max_steps_per_rl_step=8),
    # Traces of up to 32-digit additions (configs/sft.py:long_tail; the warm start and its
    # drafter are trained first, once): median answer ~32 tokens, the longest of a step's
    # 64 samples ~200, so most of a rollout's steps run in the tail, as in TLT's traces.
    # The tuner may speculate at any batch size (max_active = num_slots): on this CPU a
    # verify step of 64 sequences still pays, which the bandit measures (it chose
    # speculation for ~95% of tokens); TLT's threshold of 32 left half the tokens plain.
    "cpu_long": dict(layers=16, steps=20, warmup_steps=3, prompts_per_step=8, num_samples=8, max_tokens=288,
                     num_slots=64, catch_up_steps=2, max_steps_per_rl_step=8, warm_start="long_tail",
                     max_prompt_length=64, max_active=64),
    # The tail alone: 4 prompts x 8 samples, so every chunk runs at most 32 sequences (TLT's
    # threshold): the regime speculation is for, without the wide phase before it.
    "cpu_tail": dict(layers=16, steps=12, warmup_steps=3, prompts_per_step=4, num_samples=8, max_tokens=96,
                     num_slots=32, catch_up_steps=2, max_steps_per_rl_step=8),
    # A regime like a GPU's: the shipped model deepened to 16 layers and every MLP (the
    # drafter's too) padded with units that add nothing (`transformer.pad_mlp`) until the
    # weights are 3x this machine's last-level cache ("llc": `machine.mlp_size_for_cache`;
    # on a 32 MiB L3, 4096 units, 104 MB): the trained function and the drafter's features,
    # decoded at batch 1-4 in a step bound by reading the weights (on the EPYC 5.3-7.2 ms;
    # at batch 1 a verify of 4-5 tokens costs one step, docs/benchmarks.md). The run records
    # the machine and the regime check (`machine.regime_check`). The tail preset's shape.
    "cpu_wide": dict(layers=16, mlp_size="llc", steps=10, warmup_steps=3, prompts_per_step=4, num_samples=8,
                     max_tokens=96, num_slots=32, catch_up_steps=2, max_steps_per_rl_step=8),
    # cpu_wide's regime in the rollout alone: the engine decodes the 16-layer target with
    # every MLP padded with zero units to 3x the last-level cache (`rollout.decode_mlp_size`:
    # the same tokens), while the learner and the drafter train the model as it is,
    # as a GPU's learner is not slowed by decode's weight reads. 2 prompts x 8 samples, so
    # the tail runs at the small batches where a verify of a few tokens costs about a step.
    "cpu_wide_decode": dict(layers=16, decode_mlp_size="llc", steps=10, warmup_steps=3, prompts_per_step=2,
                            num_samples=8, max_tokens=96, num_slots=16, catch_up_steps=2, max_steps_per_rl_step=8),
    # cpu_wide_decode's regime on cpu_long's tasks: the long-tail warm start decoded with
    # every MLP padded to 3x the cache, 2 prompts x 8 samples, so after the first few
    # dozen tokens the rollout runs at batch 1-8, where on these CPUs a decode step is
    # bound by reading the weights (cpu_long's batch-64 phase is not: there a
    # padded verify costs 2-4 steps, docs/benchmarks.md).
    "cpu_wide_tail": dict(layers=16, decode_mlp_size="llc", steps=12, warmup_steps=3, prompts_per_step=2,
                          num_samples=8, max_tokens=288, num_slots=16, catch_up_steps=2, max_steps_per_rl_step=8,
                          warm_start="long_tail", max_prompt_length=64),
    # cpu_wide_tail with one prompt's pair of samples a step, so the whole rollout runs at
    # batch 2 then 1: the only batches at which decode on these CPUs is bound by reading the
    # weights, as a GPU's is up to tens of sequences (docs/benchmarks.md: a verify of 5-7
    # tokens costs 1.2-2 steps at batch 1-2, 2-4 at batch 8-64). The learner's micro-batch
    # fits the step's one or two packed rows, not 16 rows of padding; so does the drafter's
    # batch: the buffer holds the last 2 steps' 4 samples, and a batch of 16 rows would draw
    # them 4 times over (with replacement), 4x the compute of a catch-up step for the same rows.
    # The drafter, warm-started, trains online at 1e-4: at the default 1e-3 it drafted worse
    # than the frozen one (acceptance 4.7-5.0 against 5.5-6.9, docs/benchmarks.md). With one
    # rollout group no device idles, so every drafter step is a catch-up step that lengthens
    # the RL step (2 of ~11 ms each, 6% of it): they may take at most 2% of the run's time.
    "cpu_wide_pair": dict(layers=16, decode_mlp_size="llc", steps=24, warmup_steps=3, prompts_per_step=1,
                          num_samples=2, max_tokens=288, num_slots=2, catch_up_steps=2, max_steps_per_rl_step=8,
                          warm_start="long_tail", max_prompt_length=64,
                          learner=dict(micro_batch_size=8, num_minibatches=1),
                          drafter=dict(batch_size=4, optimizer=dict(learning_rate=1e-4)),
                          spot=dict(catch_up_max_share=0.02)),
    # Drift that RL itself makes: cpu_wide_pair's long-tail tasks at a policy learning rate
    # 4x the tiny job's (2e-4), 2 prompts x 4 samples a step (G = 4: GRPO has signal) over
    # 60 steps, the tuner pinned to one EAGLE arm at every batch (`pin_arm`), so that live
    # acceptance compares drafters, not the arms chosen; speculation coupled (`coupled`:
    # rollout.spec_coupled), so that every mode draws the same samples and the policy takes
    # one trajectory whatever the drafter. The offline drafter learned the
    # dataset's correct traces, so RL may move the policy toward what it drafts well: here
    # TLT must lose nothing against the frozen drafter (docs/tlt.md).
    "cpu_drift_rl": dict(layers=16, decode_mlp_size="llc", steps=60, warmup_steps=3, prompts_per_step=2,
                         num_samples=4, max_tokens=288, num_slots=8, catch_up_steps=8, max_steps_per_rl_step=8,
                         warm_start="long_tail", max_prompt_length=64, pin_arm="eagle-d6", thirds=True, coupled=True,
                         learner=dict(micro_batch_size=8, num_minibatches=1, optimizer=dict(learning_rate=2e-4)),
                         drafter=_DRIFT_DRAFTER, scratch=_SCRATCH),
    # A change of response style between warm start and RL: the warm start (configs/sft.py:
    # drift_shift) and its offline drafter saw additions (A) and a small share of countdowns
    # (B); RL trains on both, one prompt of each a step (balance_tasks), so B's completions
    # change as B is learned and the frozen drafter goes stale there.
    "cpu_drift_shift": dict(layers=16, decode_mlp_size="llc", steps=60, warmup_steps=3, prompts_per_step=2,
                            num_samples=4, max_tokens=224, num_slots=8, catch_up_steps=8, max_steps_per_rl_step=8,
                            warm_start="drift_shift", max_prompt_length=48, pin_arm="eagle-d6", thirds=True,
                            coupled=True, rl_tasks=tasks_drift_shift, balance_tasks=True,
                            learner=dict(micro_batch_size=8, num_minibatches=1, optimizer=dict(learning_rate=2e-4)),
                            drafter=_DRIFT_DRAFTER, scratch=_SCRATCH),
    # Drift while the policy learns: the warm start (configs/sft.py:drift_learn) answers its
    # additions of 3-5 digits mostly bare (often wrong) and now and then by the worked trace
    # (mostly right), nothing in the prompt choosing; correctness alone moves the policy to
    # the trace, so accuracy climbs while its responses double in length and change format,
    # away from the bare answers its offline drafter (configs/drafter.py:drift_learn) drafts.
    # The policy rate, 3e-5, puts the switch to the trace in the middle third, so that the
    # first third answers mostly bare and the last by the trace (docs/benchmarks.md,
    # "cpu_drift_learn: the warm start", has the rate sweep).
    # The online drafter has a format to learn, not a drift to follow: it needs both many steps
    # (32 of 16 rows an RL step, at 1e-3) and a wide window (the last 8 RL steps' rows); either
    # alone memorises the few samples it sees. A drafter from nothing takes the same 32 steps,
    # uncapped, over the last 16 RL steps' rows at 3e-3. docs/benchmarks.md ("cpu_drift_learn:
    # the drafter trained on the spot against the frozen one") has the recipes compared.
    "cpu_drift_learn": dict(layers=16, decode_mlp_size="llc", steps=60, warmup_steps=3, prompts_per_step=2,
                            num_samples=8, max_tokens=96, num_slots=16, catch_up_steps=32, max_steps_per_rl_step=32,
                            warm_start="drift_learn", max_prompt_length=24, pin_arm="eagle-d6", thirds=True,
                            coupled=True, eval_every=10,
                            learner=dict(micro_batch_size=16, num_minibatches=1, optimizer=dict(learning_rate=3e-5)),
                            drafter=dict(_DRIFT_DRAFTER, batch_size=16, keep_steps=8,
                                         optimizer=dict(learning_rate=1e-3)),
                            scratch=dict(drafter=dict(_SCRATCH["drafter"], keep_steps=16,
                                                      optimizer=dict(learning_rate=3e-3)),
                                         spot=dict(catch_up_steps=32, catch_up_max_share=1.0))),
    # The seeds' two kinds of work, cpu_drift_learn's harness (coupled, eagle-d6 pinned, thirds,
    # its online drafter's recipe) on a Qwen2 with a byte-level BPE (experiments/make_seed_model.py)
    # deepened to 16 layers: code (configs/sft.py:code, the MBPP-style set scored by the `code`
    # reward in its sandbox, the share of a row's 3 asserts passed) and planning
    # (configs/sft.py:plan, a Tower of Hanoi of 2-4 disks planned in one answer, scored 1 for a
    # plan that solves it). Each warm start was taught briefly, so RL has wrong answers left to
    # fix; its offline drafter learned its own answers (configs/drafter.py:code, :plan), which
    # RL then moves away from. 4 prompts x 8 samples a step over 15 steps, evaluated every 5
    # steps on 32 held-out prompts (greedy); 15 steps, since a code step runs sandboxes for every
    # sample (docs/benchmarks.md has the cost).
    "cpu_code": dict(layers=16, steps=15, warmup_steps=3, prompts_per_step=4, num_samples=8, max_tokens=32,
                     num_slots=32, catch_up_steps=32, max_steps_per_rl_step=32, warm_start="code",
                     max_prompt_length=40, num_eval=32, pin_arm="eagle-d6", thirds=True, coupled=True, eval_every=5,
                     learner=dict(micro_batch_size=32, num_minibatches=1, optimizer=dict(learning_rate=1e-4)),
                     drafter=dict(_DRIFT_DRAFTER, batch_size=16, keep_steps=8, optimizer=dict(learning_rate=1e-3))),
    "cpu_plan": dict(layers=16, steps=15, warmup_steps=3, prompts_per_step=4, num_samples=8, max_tokens=64,
                     num_slots=32, catch_up_steps=32, max_steps_per_rl_step=32, warm_start="plan",
                     max_prompt_length=40, num_eval=32, pin_arm="eagle-d6", thirds=True, coupled=True, eval_every=5,
                     learner=dict(micro_batch_size=32, num_minibatches=1, optimizer=dict(learning_rate=1e-4)),
                     drafter=dict(_DRIFT_DRAFTER, batch_size=16, keep_steps=8, optimizer=dict(learning_rate=1e-3))),
    # Multi-turn: cpu_wide_tail's regime and tasks, every sample two turns with an
    # environment step between them that sleeps a fixed time (`env`: latency_ms;
    # --env_latency_ms): the worked answer up to "answer:", the step, then the answer
    # (experiments/scripted_env.py). TLT cannot shorten an environment's latency:
    # `decode_speedup` (the decode chunks alone) is its measure, beside the rollout's and
    # the step's; --noenv_overlap runs the environments with decoding stopped meanwhile.
    "cpu_wide_env": dict(layers=16, decode_mlp_size="llc", steps=12, warmup_steps=3, prompts_per_step=2,
                         num_samples=8, max_tokens=288, num_slots=16, catch_up_steps=2, max_steps_per_rl_step=8,
                         warm_start="long_tail", max_prompt_length=64, env=dict(latency_ms=20.0)),
    # The H200's, on the spec block's 16-layer 180M target (`--target`: used as it is; without
    # it, the shipped model deepened to 48 layers). 2 prompts x 8 samples, so
    # the rollout runs at TLT's batches (<= 32) and dominates the step: with 32 x 8 its
    # baseline rollout was 37% of the step (0.20 of 0.54 s, docs/benchmarks.md, 2026-12-04).
    # One update per step (on-policy: no old-policy pass).
    "gpu": dict(layers=48, steps=10, warmup_steps=3, prompts_per_step=2, num_samples=8, max_tokens=96,
                num_slots=16, catch_up_steps=4, max_steps_per_rl_step=16,
                learner=dict(micro_batch_size=16, num_minibatches=1)),
}
# The gpu preset with environment steps (cpu_wide_env's scripted environment), for the
# device machine's agents block.
PRESETS["gpu_env"] = dict(PRESETS["gpu"], env=dict(latency_ms=20.0))
# The per-step series the speed-ups pair: (metric, name of the speed-up).
_SPEEDUPS = (("time_rollout_chunks_s", "decode"), ("time_rollout_s", "rollout"), ("time_step_s", "step"))
_TIMES = ("time_rollout_s", "time_reward_s", "time_batch_s", "time_old_logp_s", "time_learner_s",
          "time_weight_sync_s", "time_tlt_end_s", "time_step_s")


def build_warm_start(name: str, cache_dir: str) -> tuple[str, str]:
    """(SFT model dir, drafter export dir): those shipped in assets/ ("assets": the tiny
    main job's; else assets/sft_<name> and assets/drafter_<name> where the repository
    ships them, the very models its figures were measured from), or those of
    configs/sft.py:<name> and configs/drafter.py:<name> trained once into cache_dir."""
    if name == "assets":
        return "assets/sft_tiny", "assets/drafter_tiny"
    shipped = os.path.join("assets", f"sft_{name}"), os.path.join("assets", f"drafter_{name}")
    if all(os.path.isdir(d) for d in shipped):
        return shipped
    from configs import drafter as drafter_configs
    from configs import sft as sft_configs
    from tlt_jax.drafter_training.trainer import train_drafter
    from tlt_jax.sft import train_sft

    sft_config = sft_configs.get_config(name)
    sft_config.run_dir = os.path.join(cache_dir, f"sft_{name}")
    sft_dir = os.path.join(sft_config.run_dir, "hf")
    if not os.path.exists(sft_dir):
        print(f"training the {name} warm start once: {sft_config.steps} SFT steps into {sft_config.run_dir}")
        train_sft(sft_config)
    drafter_config = drafter_configs.get_config(name)
    drafter_config.target_dir = sft_dir
    drafter_config.run_dir = os.path.join(cache_dir, f"drafter_{name}")
    drafter_dir = os.path.join(drafter_config.run_dir, "drafter")
    if not os.path.exists(drafter_dir):
        print(f"training its drafter once: {drafter_config.steps} steps into {drafter_config.run_dir}")
        train_drafter(drafter_config)
    return sft_dir, drafter_dir


def build_target(layers: int, cache_dir: str, warm_start: str = "assets", mlp_size: int | str = 0) -> tuple[str, str]:
    """(target HF dir, drafter export dir) of the preset, built once from its warm start
    (with mlp_size, every MLP of target and drafter padded to that many units; "llc": to 3x
    this machine's last-level cache, `machine.mlp_size_for_cache`)."""
    sft_dir, sft_drafter_dir = build_warm_start(warm_start, cache_dir)
    if mlp_size == "llc":
        cfg, params = load_hf(sft_dir)
        deep = tfm.append_identity_layers(jax.tree.map(jnp.asarray, params), cfg, layers)
        mlp_size = machine.mlp_size_for_cache(*deep)
    # Named by the warm start's drafter too: a drafter retrained or shipped anew builds anew.
    drafter_id = fingerprint.fingerprint_path(sft_drafter_dir).removeprefix("sha256:")[:8]
    suffix = ("" if warm_start == "assets" else f"_{warm_start}") + f"_{drafter_id}" + (
        f"_f{mlp_size}" if mlp_size else "")
    target_dir = os.path.join(cache_dir, f"target_l{layers}{suffix}")
    drafter_dir = os.path.join(cache_dir, f"drafter_l{layers}{suffix}")
    if not os.path.exists(os.path.join(drafter_dir)):
        cfg, params = load_hf(sft_dir)
        narrow = cfg
        cfg, params = tfm.append_identity_layers(jax.tree.map(jnp.asarray, params), cfg, layers)
        if mlp_size:
            cfg, params = tfm.pad_mlp(params, cfg, mlp_size)
        params = jax.device_get(params)
        save_hf(target_dir, cfg, params, tokenizer=load_tokenizer(sft_dir), overwrite=True)
        # The drafter reads the final hidden state, which the appended layers (and units)
        # leave as it was: re-exported for the deeper target, its layer's MLP as wide.
        dcfg, dparams = drafter_io.load_drafter(sft_drafter_dir)
        if mlp_size:
            dparams = tfm.pad_mlp(dparams, dcfg.layer_config(narrow), mlp_size)[1]
        drafter_io.save_drafter(drafter_dir, dparams, dcfg, cfg, fingerprint.fingerprint_arrays(params))
    return target_dir, drafter_dir


def _decode_mlp_size(preset: dict, target_dir: str | None) -> int:
    """Decode's MLP width: --decode_mlp_size, else the preset's; "llc" sized from this
    machine's last-level cache for the target in target_dir (None: not built yet, 0)."""
    if _DECODE_MLP_SIZE.value is not None:
        return _DECODE_MLP_SIZE.value
    size = preset.get("decode_mlp_size", 0)
    if size != "llc":
        return size
    return 0 if target_dir is None else _mlp_size_for_cache(target_dir)


@functools.cache
def _mlp_size_for_cache(target_dir: str) -> int:
    return machine.mlp_size_for_cache(*load_hf(target_dir))


def mode_config(mode: str, preset: dict, target_dir: str, drafter_dir: str, seed: int, steps: int,
                built: bool = True):
    """The run config of `mode` (built: the target exists, so a width sized from the cache
    can be read off it; False checks the flags before anything is built)."""
    c = rl_configs.get_config("tiny")
    rl_configs.use_reference_rollout(c)  # as every preset was measured
    c.model_dir, c.seed, c.steps = target_dir, seed, steps
    c.prompts_per_step, c.num_samples = preset["prompts_per_step"], preset["num_samples"]
    c.rollout.update(num_slots=preset["num_slots"], max_tokens=preset["max_tokens"],
                     decode_mlp_size=_decode_mlp_size(preset, target_dir if built else None),
                     spec_coupled=preset.get("coupled", False))
    if preset.get("warm_start", "assets") != "assets":
        from configs import sft as sft_configs

        sft_config = sft_configs.get_config(preset["warm_start"])
        if sft_config.data.source == "files":  # its dataset's prompts, scored by its reward
            c.data = sft_config.data.copy_and_resolve_references()
            c.data.update(response_field="", num_eval=preset["num_eval"], seed=1)
            c.reward = sft_config.reward
            c.code.update(sft_config.code)
        else:
            c.data.tasks = preset["rl_tasks"]() if "rl_tasks" in preset else sft_config.data.tasks
        c.rollout.max_prompt_length = preset["max_prompt_length"]
    c.balance_tasks = preset.get("balance_tasks", False)
    c.learner.update(preset.get("learner", {}))
    c.eval_every, c.checkpoint_every, c.save_hf = min(preset.get("eval_every", steps), steps), steps, False
    # How far the policy moves (policy_kl_from_start): the reference forward, in every mode,
    # is timed as a phase of its own and left out of the times compared (`summarise`).
    c.track_kl = True
    if _SLOW_REWARD_MS.value:
        c.reward = slow_reward.name(c.reward, _SLOW_REWARD_MS.value)
    env = env_settings(preset)
    if env:  # the environment's reward alone (1 where the answer is right)
        c.env.update(name=scripted_env.name(env["env_latency_ms"]), max_turns=scripted_env.TURNS,
                     overlap=env["env_overlap"])
        c.reward = ""
    c.reward_overlap, c.reward_workers = _REWARD_OVERLAP.value, _REWARD_WORKERS.value
    c.run_dir = os.path.join(_RUN_DIR.value, f"{mode}_s{seed}")
    c.tlt.enabled = mode != "baseline"
    c.tlt.drafter.update(preset.get("drafter", {}), init=drafter_dir)
    c.tlt.drafter.checkpoint_every = steps
    c.tlt.spot.update(preset.get("spot", {}), catch_up_steps=preset["catch_up_steps"],
                      max_steps_per_rl_step=preset["max_steps_per_rl_step"])
    if "max_active" in preset:
        c.tlt.tuner.max_active = preset["max_active"]
    pin_arm = preset.get("pin_arm", "") if _PIN_ARM.value is None else _PIN_ARM.value
    if pin_arm and mode in ("tlt", "frozen", "scratch"):  # one arm at every batch: drafters compared, not arms
        c.tlt.tuner.update(buckets=[1], arms=[[pin_arm]], max_active=preset["num_slots"])
    if mode == "scratch":  # a drafter from nothing, with the preset's recipe for one (`scratch`)
        c.tlt.drafter.init = ""
        c.tlt.drafter.update(preset.get("scratch", {}).get("drafter", {}))
        c.tlt.spot.update(preset.get("scratch", {}).get("spot", {}))
    if mode == "ngram":
        c.tlt.tuner.arms = [[a for a in arms if not a.startswith("eagle")] for arms in c.tlt.tuner.arms]
    if mode == "history":
        c.tlt.tuner.arms = [[a.replace("ngram", "history") for a in arms if not a.startswith("eagle")]
                            for arms in c.tlt.tuner.arms]
    _override(c, _SET.value)
    if mode != "baseline":
        _override(c, _TLT_SET.value)
    if mode == "frozen":  # never trained, whatever --tlt_set gives the trained modes
        c.tlt.spot.update(catch_up_steps=0, max_steps_per_rl_step=0)
    return c


def env_settings(preset: dict) -> dict:
    """A preset's environment steps as the flags set them ({} without: a single-turn preset)."""
    if "env" not in preset:
        return {}
    return dict(env_turns=scripted_env.TURNS,
                env_latency_ms=preset["env"]["latency_ms"] if _ENV_LATENCY_MS.value is None else _ENV_LATENCY_MS.value,
                env_overlap=_ENV_OVERLAP.value)


def _override(config, items: list[str]) -> None:
    """Applies key=value overrides (a Python literal, cast to the field's type) to `config`."""
    for item in items:
        key, _, value = item.partition("=")
        *path, leaf = key.split(".")
        node = config
        try:
            for name in path:
                node = node[name]
            node[leaf] = type(node[leaf])(ast.literal_eval(value))
        except (KeyError, ValueError, SyntaxError, TypeError) as e:
            raise ValueError(f"--set/--tlt_set {item!r}: {key} is not a field of the run's config (configs/rl.py) "
                             f"or {value!r} is not a value of its type: {e}") from e


def _by_depth(record: dict) -> list[float]:
    """A step's accept_depth_<d> metrics in order of d (those its rollout reached)."""
    return [v for _, v in sorted((int(k.rsplit("_", 1)[1]), v) for k, v in record.items()
                                 if k.startswith("accept_depth_"))]


def _without_reference(record: dict) -> dict:
    """A step's record with the reference forward (time_ref_logp_s, run for
    policy_kl_from_start alone) taken out of the learner's and the step's times."""
    ref = record.get("time_ref_logp_s", 0.0)
    return {**record, "time_learner_s": record["time_learner_s"] - ref, "time_step_s": record["time_step_s"] - ref}


def _by_task(steps: list[dict]) -> dict:
    """{task: {"served_accept_rate": per step, "initial_accept_rate": per step, and each's
    thirds}} from the steps' drafter/{served,initial}_accept_rate/<task> metrics."""
    tasks = sorted({k.rsplit("/", 1)[1] for r in steps for k in r if k.startswith("drafter/served_accept_rate/")})
    out = {}
    for task in tasks:
        series = {name: [r.get(f"drafter/{name}/{task}") for r in steps]
                  for name in ("served_accept_rate", "initial_accept_rate")}
        out[task] = dict(series, thirds={name: thirds(values) for name, values in series.items()})
    return out


def summarise(records: list[dict], warmup: int) -> dict:
    steps = [_without_reference(r) for r in records if "time_step_s" in r]
    steady = steps[warmup:] or steps
    med = {k: statistics.median(r.get(k, 0.0) for r in steady) for k in (*_TIMES, "time_rollout_chunks_s")}
    first = sum(r["time_step_s"] for r in steps[:warmup])
    # The drafter that served each step, teacher-forced on that step's sequences (None: no
    # drafter); the run's starting drafter on the same rows (staleness, whatever the arms);
    # how far the policy has moved from its start; rollout tokens/s.
    series = {name: [r.get(key) for r in steps] for name, key in (
        ("served_accept_rate", "drafter/served_accept_rate"), ("initial_accept_rate", "drafter/initial_accept_rate"),
        ("policy_kl_from_start", "policy_kl_from_start"), ("rollout_tokens_per_s", "rollout_tokens_per_s"))}
    acceptance = [r["acceptance_length"] for r in steps]
    return dict(median=med, compile_s=max(0.0, first - warmup * med["time_step_s"]),
                steady_steps=[r["step"] for r in steady],
                # The decode chunks alone (rollout_split's `chunks`): what TLT can shorten when
                # environments' latency is in the rollout too.
                steady_times={k: [r.get(k, 0.0) for r in steady] for k, _ in _SPEEDUPS},
                acceptance_length=acceptance,
                served_accept_rate=series["served_accept_rate"],
                initial_accept_rate=series["initial_accept_rate"],
                policy_kl_from_start=series["policy_kl_from_start"],
                # Live acceptance per draft position (whatever arms ran).
                acceptance_by_depth=[_by_depth(r) for r in steps],
                speculative_token_share=[r["speculative_token_share"] for r in steps],
                drafter_version=[r.get("drafter_version", 0) for r in steps],
                drafter_steps=[r.get("spot/steps", 0) + r.get("spot/catch_up_steps", 0) for r in steps],
                hidden_share=[r.get("spot/hidden_share", 1.0) for r in steps],
                preemption_delay_max_s=[r.get("spot/preemption_delay_max_s", 0.0) for r in steps],
                response_length_mean=[r["response_length_mean"] for r in steps],
                # Equal across modes for a step where they drew the same samples (`rollout.spec_coupled`).
                samples_digest=[r.get("samples_digest") for r in steps],
                reward_mean=[r["reward_mean"] for r in steps],
                # Beside time_reward_s (the reward's time after the rollout): the seconds it ran in all.
                reward_scoring_s=statistics.median(r.get("time_reward_scoring_s", 0.0) for r in steady),
                rollout_tokens_per_s=statistics.median(r["rollout_tokens_per_s"] for r in steady),
                rollout_tokens_per_s_steps=series["rollout_tokens_per_s"],
                eval_accuracy=[r.get("eval_accuracy") for r in records if "eval_accuracy" in r],
                eval_steps=[r.get("step") for r in records if "eval_accuracy" in r],
                # Over the first and the last third of the steps: staleness and recovery (a step
                # with no speculative chunk has no acceptance length: skipped, not 0).
                thirds={"acceptance_length": thirds([a if a > 0 else None for a in acceptance]),
                        **{name: thirds(values) for name, values in series.items()}},
                # With several tasks a step: each task's rows scored apart, served and starting drafter.
                by_task=_by_task(steps),
                # Where the rollout's wall went (medians; metrics of `RLLoop.step`).
                rollout_split={part: statistics.median(r.get(f"time_rollout_{part}_s", 0.0) for r in steady)
                               for part in ROLLOUT_PARTS})


def plot_from(paths: list[str], out: str) -> str:
    """The acceptance plot (`plot_acceptance`) of the modes of earlier results, each mode
    from its first run among `paths`; returns the plot's path."""
    if not out:
        raise ValueError("--plot_from needs --out: the plot goes beside it (<out>_acceptance.png).")
    modes = first_runs(read_results(paths))
    if not any(m in modes for m in PLOTTED_MODES):
        raise ValueError(f"--plot_from: no drafter mode ({', '.join(PLOTTED_MODES)}) in {', '.join(paths)}.")
    plot = _acceptance_plot_path(out)
    plot_acceptance(modes, plot)
    return plot


def main(argv):
    del argv
    if _PLOT_FROM.value:
        print(f"wrote {plot_from(_PLOT_FROM.value, OUT.value)}")
        return
    modes = [*_MODES.value, *([_SINGLE_MODE.value] if _SINGLE_MODE.value else [])]
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}: the modes are {', '.join(MODES)}.")
    if not _SLOW_REWARD_MS.value >= 0:
        raise ValueError(f"--slow_reward_ms={_SLOW_REWARD_MS.value} must be >= 0 (milliseconds per sample; 0: the "
                         "task reward as it is).")
    if _REPEATS.value < 0:
        raise ValueError(f"--repeats={_REPEATS.value} must be 0 (one process) or more (pairs of runs).")
    if "env" not in PRESETS[_PRESET.value] and (_ENV_LATENCY_MS.value is not None or not _ENV_OVERLAP.value):
        raise ValueError(f"--env_latency_ms and --env_overlap apply to a preset with environment steps (cpu_wide_env, "
                         f"gpu_env), not --preset={_PRESET.value}.")
    if "env" in PRESETS[_PRESET.value] and _SLOW_REWARD_MS.value:
        raise ValueError(f"--slow_reward_ms: preset {_PRESET.value} scores by its environment's step rewards; its "
                         "latency is --env_latency_ms.")
    if settings := env_settings(PRESETS[_PRESET.value]):
        scripted_env.name(settings["env_latency_ms"])  # refuses a bad value, naming it
    if bool(_TARGET.value) != bool(_DRAFTER.value):
        raise ValueError("Pass --target and --drafter together (or neither, for the preset's own).")
    preset, steps = PRESETS[_PRESET.value], STEPS.value or PRESETS[_PRESET.value]["steps"]
    if preset.get("thirds") and steps - preset["warmup_steps"] < 6:
        raise ValueError(f"--steps={steps}: preset {_PRESET.value} compares the first and the last third of the "
                         f"steps after its {preset['warmup_steps']} warm-up steps, so it needs at least "
                         f"{preset['warmup_steps'] + 6}.")
    for mode in modes:  # a bad --set or --tlt_set fails here, before any run starts
        mode_config(mode, preset, "target", "drafter", SEED.value, 1, built=False)
    if _SINGLE_MODE.value or _REPEATS.value == 0:
        print_in_process(run_in_process([_SINGLE_MODE.value] if _SINGLE_MODE.value else _MODES.value))
    else:
        sys.exit(run_repeats())


def _machine_and_regime(preset: dict, target_dir: str) -> dict:
    """The machine (CPU model, last-level cache) and, with --regime_check, the target's
    decode step at batch 1, 2 and 4 as the runs decode it (`machine.regime_check`)."""
    out = dict(machine=machine.machine_record())
    # On the CPU presets only: this process decodes on the CPU, which says nothing of a GPU's runs.
    if _REGIME_CHECK.value and _PRESET.value.startswith("cpu"):
        cfg, params = load_hf(target_dir)
        prompt = load_tokenizer(target_dir)("add 123+4567\n")["input_ids"]
        step_s = machine.decode_step_seconds(cfg, params, _decode_mlp_size(preset, target_dir), prompt)
        out["regime"] = machine.regime_check(step_s)
        r = out["regime"]
        print(f"regime check ({out['machine']['cpu']}, last-level cache "
              f"{(out['machine']['last_level_cache_bytes'] or 0) / 2**20:.0f} MiB): decode step at batch "
              + ", ".join(f"{b}: {v * 1e3:.2f} ms" for b, v in r["step_s"].items())
              + f"; spread {r['spread']:.0%} ({'within' if r['passed'] else 'beyond'} {r['tolerance']:.0%}: "
              + ("bound by reading the weights, as on a GPU)" if r["passed"] else
                 "NOT bound by reading the weights: its speed-ups are not a GPU's)"), flush=True)
    return out


def _target(preset: dict) -> tuple[str, str]:
    if _TARGET.value:
        return _TARGET.value, _DRAFTER.value
    return build_target(preset["layers"], CACHE.value, preset.get("warm_start", "assets"), preset.get("mlp_size", 0))


def _target_layers(preset: dict) -> int:
    """The layers of the target the runs decode: --target's own (used as it is), else the preset's."""
    if _TARGET.value:
        with open(os.path.join(_TARGET.value, "config.json")) as f:
            return int(json.load(f)["num_hidden_layers"])
    return preset["layers"]


def run_in_process(modes: list[str]) -> dict:
    """Runs `modes` back to back in this process; writes --out after each. With both
    baseline and tlt, the speed-ups of this one process (`*_in_process`: they depend on the
    order, see the module docstring)."""
    launch.maybe_initialize_distributed()
    preset = PRESETS[_PRESET.value]
    steps = STEPS.value or preset["steps"]
    # Repeated runs (and the second mode's learner, the same programs) skip compiles.
    launch.enable_compilation_cache(xla_cache_dir())
    t0 = time.perf_counter()
    target_dir, drafter_dir = _target(preset)
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  preset=_PRESET.value, seed=SEED.value, steps=steps, layers=_target_layers(preset),
                  decode_mlp_size=_decode_mlp_size(preset, target_dir), set=_SET.value, tlt_set=_TLT_SET.value,
                  build_s=time.perf_counter() - t0, modes={}, **_reward_settings())
    if not _SINGLE_MODE.value:
        result.update(_machine_and_regime(preset, target_dir))
    for mode in modes:
        config = mode_config(mode, preset, target_dir, drafter_dir, SEED.value, steps)
        if os.path.exists(config.run_dir):  # a benchmark measures fresh runs, never a resumed one
            shutil.rmtree(config.run_dir)
        t_mode = time.perf_counter()
        programs = cached_programs()
        summary = train_rl(config, progress=True)
        records = metrics.read_metrics(os.path.join(config.run_dir, metrics.METRICS_FILENAME))
        result["modes"][mode] = dict(summarise(records, preset["warmup_steps"]), wall_s=time.perf_counter() - t_mode,
                                     final_eval_accuracy=summary["final_eval_accuracy"],
                                     sft_eval_accuracy=summary["sft_eval_accuracy"], tlt=summary.get("tlt"),
                                     new_compiled_programs=cached_programs() - programs)
        _write(result)
    modes = result["modes"]
    if "baseline" in modes and "tlt" in modes:
        b, t = modes["baseline"]["median"], modes["tlt"]["median"]
        speedups = dict(**paired_speedups(modes["baseline"], modes["tlt"]),
                        rollout_speedup_of_medians=b["time_rollout_s"] / t["time_rollout_s"],
                        step_speedup_of_medians=b["time_step_s"] / t["time_step_s"])
        result.update(
            rollout_time_s={"baseline": b["time_rollout_s"], "tlt": t["time_rollout_s"]},
            step_time_s={"baseline": b["time_step_s"], "tlt": t["time_step_s"]},
            **{f"{k}_in_process": v for k, v in speedups.items()},
            acceptance_length=modes["tlt"]["acceptance_length"],
            final_eval_accuracy={"baseline": modes["baseline"]["final_eval_accuracy"],
                                 "tlt": modes["tlt"]["final_eval_accuracy"]})
    in_process = [dict(run=i, pair=1, mode=m, result=dict(modes={m: s})) for i, (m, s) in enumerate(modes.items(), 1)]
    result.update({f"{k}_in_process": v for k, v in drafter_comparisons(in_process).items()})
    if preset.get("thirds") and not _SINGLE_MODE.value:
        result["bars"] = [dataclasses.asdict(v) for v in verdicts(result)]
    _write(result)
    if OUT.value and not _SINGLE_MODE.value and any(m in modes for m in PLOTTED_MODES):
        plot_acceptance(modes, _acceptance_plot_path(OUT.value))
    return result


def _timed_steps(preset: dict, steps: int) -> str:
    first = preset["warmup_steps"] + 1 if steps > preset["warmup_steps"] else 1
    return f"medians over steps {first}..{steps}"


def print_in_process(result: dict) -> None:
    preset = PRESETS[result["preset"]]
    modes = result["modes"]
    layers = result.get("layers", preset["layers"])
    print(f"\nbackend {result['backend']}, preset {result['preset']} ({layers}-layer target), seed "
          f"{result['seed']}, {result['steps']} steps per mode, one process; "
          f"{_timed_steps(preset, result['steps'])}")
    _print_table([(f"{mode:9}", m) for mode, m in modes.items()], f"{'mode':9}")
    _print_rewards(result, [(mode, m) for mode, m in modes.items()])
    _print_rollout_split([(mode, m) for mode, m in modes.items()])
    if "rollout_speedup_in_process" in result:
        decode = result.get("decode_speedup_in_process")
        print(f"in one process, {' then '.join(modes)}: "
              + (f"decode speed-up {decode:.2f}x, " if decode else "")
              + f"rollout speed-up {result['rollout_speedup_in_process']:.2f}x, "
              f"step speed-up {result['step_speedup_in_process']:.2f}x (medians of the per-step ratios; the second "
              "mode in a process runs faster, whichever it is: --repeats=2 runs each in a fresh process, ABBA)")
        print(f"whole run: rollout {result['rollout_speedup_total_in_process']:.2f}x, step "
              f"{result['step_speedup_total_in_process']:.2f}x (ratio of sums); ratio of the medians: rollout "
              f"{result['rollout_speedup_of_medians_in_process']:.2f}x, step "
              f"{result['step_speedup_of_medians_in_process']:.2f}x")
    _print_drafter_comparisons(result)
    if preset.get("thirds"):
        print_verdicts(result)
    _warn_compiles({mode: m["new_compiled_programs"] for mode, m in modes.items()})


def _print_drafter_comparisons(result: dict) -> None:
    """`drafter_comparisons`' figures, and per mode the policy's KL and the drafters'
    acceptance over the first and the last third of the steps."""
    for key, v in result.items():
        if "_versus_frozen" in key:
            print(f"{key.replace('_', ' ')}, over the last third of the steps: acceptance length "
                  f"{v.get('acceptance_length_last_third', float('nan')):.2f}x, rollout tokens/s "
                  f"{v.get('rollout_tokens_per_s_last_third', float('nan')):.2f}x (geometric means over "
                  f"{len(v['pairs'])} pair{'s' * (len(v['pairs']) != 1)}); steps with the same samples: "
                  + ", ".join(str(p["same_samples_steps"]) for p in v["pairs"]))
    fmt = lambda t: ("n/a" if not t or t["first"] is None or t["last"] is None
                     else f"{t['first']:.3f} -> {t['last']:.3f}")
    for mode, m in result.get("modes", {}).items():
        th = m.get("thirds", {})
        if th:
            print(f"{mode}, first third -> last third: policy KL {fmt(th.get('policy_kl_from_start'))}, live "
                  f"acceptance {fmt(th.get('acceptance_length'))}, served drafter {fmt(th.get('served_accept_rate'))}, "
                  f"starting drafter {fmt(th.get('initial_accept_rate'))}" + "".join(
                      f"; {task}: served {fmt(t['thirds']['served_accept_rate'])}, starting "
                      f"{fmt(t['thirds']['initial_accept_rate'])}" for task, t in m.get("by_task", {}).items()))


def _print_table(rows: list[tuple[str, dict]], head: str) -> None:
    """One line per (label, mode summary): the phase medians, compile time, acceptance, eval
    accuracy; (label, a string): that string (a run that failed)."""
    print(head + "".join(f"{k[5:-2]:>12}" for k in _TIMES) + f"{'compile':>9}{'acc len':>8}{'eval acc':>9}")
    for label, m in rows:
        if isinstance(m, str):
            print(label + m)
            continue
        acc = [a for a in m.get("acceptance_length", []) if a > 0]
        print(label + "".join(f"{m['median'][k]:12.3f}" for k in _TIMES) + f"{m.get('compile_s', 0.0):9.1f}"
              f"{(statistics.mean(acc) if acc else 0.0):8.2f}{m.get('final_eval_accuracy') or 0.0:9.3f}")


def _print_rollout_split(rows: list[tuple[str, dict]]) -> None:
    """Per (label, mode summary): the median rollout's seconds in decode chunks, prefill,
    harvest and the host's other time between chunks."""
    print("rollout split (s): " + "; ".join(
        f"{label} " + " ".join(f"{part} {m['rollout_split'][part]:.3f}" for part in ROLLOUT_PARTS)
        for label, m in rows if "rollout_split" in m))


def _reward_settings() -> dict:
    return dict(slow_reward_ms=_SLOW_REWARD_MS.value, reward_overlap=_REWARD_OVERLAP.value,
                reward_workers=_REWARD_WORKERS.value, **env_settings(PRESETS[_PRESET.value]))


def _print_rewards(result: dict, rows: list[tuple[str, dict]]) -> None:
    """Per (label, mode summary): the reward's seconds after the rollout (the table's
    `reward`) beside the seconds it ran in all, medians per step."""
    if "env_turns" in result:
        schedule = "overlapped with decoding" if result["env_overlap"] else "decoding stopped meanwhile"
        print(f"environment steps: {result['env_turns']} turns a sample, {result['env_latency_ms']:g} ms a step, "
              f"{schedule}")
    print(f"rewards (slow_reward_ms={result.get('slow_reward_ms', 0.0):g}, reward_overlap="
          f"{result.get('reward_overlap', True)}, reward_workers={result.get('reward_workers', 0)}): "
          + "; ".join(f"{label} {m['median']['time_reward_s']:.3f} s after the rollout of "
                      f"{m.get('reward_scoring_s', 0.0):.3f} s scoring" for label, m in rows))


def _warn_compiles(counts: dict) -> None:
    cold = {name: n for name, n in counts.items() if n}
    if cold:
        print(f"Programs compiled during the runs (not found in {CACHE.value}/xla): {cold}. Shapes that first "
              "appear after the warm-up steps (learner rows, prefill buckets) compile inside timed steps, and a "
              "later run finds an earlier run's programs compiled: run the same command again for a fair ratio.")


def abba_order(modes: list[str], repeats: int) -> list[dict]:
    """The runs, in order: pair i (from 1) runs `modes` in order for odd i, reversed for even
    i (baseline, tlt, tlt, baseline, ...). [{"run": position from 1, "pair", "mode"}]."""
    order = []
    for pair in range(1, repeats + 1):
        for mode in (modes if pair % 2 else modes[::-1]):
            order.append(dict(run=len(order) + 1, pair=pair, mode=mode))
    return order


def child_command(mode: str, out: str) -> list[str]:
    """The command line of one run: this script with --single_mode and --out, and every flag
    given to this process but its own (_PARENT_FLAGS), as given."""
    passed = []
    for name in list(flags.FLAGS):
        flag = flags.FLAGS[name]
        if flag.name != name or not flag.present or name in _PARENT_FLAGS:
            continue  # a short alias, a default, or this process's own
        passed.extend(flag.serialize().split("\n"))
    return [sys.executable, "-m", "experiments.bench_tlt", *passed, f"--single_mode={mode}", f"--out={out}"]


def child_environment(environ: dict, platform: str = sys.platform,
                      thp_path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> tuple[dict, str]:
    """(The runs' environment, a line saying how it sets huge pages): environ with
    glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES on Linux with transparent huge pages
    (malloc's arenas on huge pages: a learner update faults in gigabytes of fresh pages,
    docs/benchmarks.md), unless GLIBC_TUNABLES already sets glibc.malloc.hugetlb."""
    env = dict(environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return env, f"runs keep GLIBC_TUNABLES={tunables} from the environment"
    if not platform.startswith("linux") or not os.path.exists(thp_path):
        return env, "no transparent huge pages on this platform: GLIBC_TUNABLES left as it is"
    env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, "glibc.malloc.hugetlb=1") if t)
    return env, (f"runs get GLIBC_TUNABLES={env['GLIBC_TUNABLES']} (malloc on transparent huge pages; added by "
                 "bench_tlt)")


def cpu_ticks(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(Steal, all) ticks of the machine's CPUs since boot, from Linux's /proc/stat; None
    elsewhere. Steal is time the hypervisor ran other machines on this one's CPUs: where it
    moves between runs, so do their timings."""
    try:
        with open(path) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7], sum(fields[:8])) if len(fields) >= 8 else None


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two `cpu_ticks` readings (None: unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def spawn(command: list[str], env: dict) -> tuple[int, str]:
    """Runs one child to its end, its stdout and stderr shown as they come; (exit status, the
    last lines of its stderr)."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    tail = b""
    while chunk := os.read(proc.stderr.fileno(), 65536):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        tail = (tail + chunk)[-4000:]
    proc.stderr.close()
    lines = tail.decode(errors="replace").replace("\r", "\n").splitlines()
    return proc.wait(), "\n".join(line for line in lines[-12:] if line.strip())


def run_repeats(launch_child=spawn) -> int:
    """Builds the preset's target, then runs the modes of --modes --repeats times each, each run
    a fresh process (`launch_child(command, env)`), in ABBA order; rewrites --out after every
    run. Returns the exit status: 1 if a run failed (the others are kept), else 0."""
    preset = PRESETS[_PRESET.value]
    steps = STEPS.value or preset["steps"]
    order = abba_order(_MODES.value, _REPEATS.value)
    parts = os.path.join(_RUN_DIR.value, "runs_parts")
    for run in order:
        run["command"] = child_command(run["mode"], os.path.join(parts, f"run{run['run']}_{run['mode']}.json"))
    env, env_note = child_environment(os.environ)
    if _PRINT_COMMANDS.value:
        print(env_note)
        for run in order:
            print(f"# run {run['run']}, pair {run['pair']}, {run['mode']}")
            print(shlex.join(run["command"]))
        return 0
    print(f"{len(order)} runs, each in a fresh process, in ABBA order: {', '.join(r['mode'] for r in order)}; "
          f"{env_note}")
    # The warm start and the target are built here, once, before any run (a cold build trains
    # the warm start); on the CPU, so that this process holds none of an accelerator's memory.
    jax.config.update("jax_platforms", "cpu")
    launch.enable_compilation_cache(xla_cache_dir())
    t0 = time.perf_counter()
    target_dir, _ = _target(preset)
    result = dict(preset=_PRESET.value, seed=SEED.value, steps=steps, layers=_target_layers(preset),
                  decode_mlp_size=_decode_mlp_size(preset, target_dir), set=_SET.value, tlt_set=_TLT_SET.value,
                  repeats=_REPEATS.value,
                  order=[r["mode"] for r in order],
                  child_environment=env_note, build_s=time.perf_counter() - t0, runs=[], **_reward_settings(),
                  **_machine_and_regime(preset, target_dir))
    failed = []
    t_start = time.perf_counter()
    for run in order:
        part = run["command"][-1].split("=", 1)[1]
        if os.path.exists(part):
            os.remove(part)
        print(f"\n== run {run['run']} of {len(order)} (pair {run['pair']}): {run['mode']}", flush=True)
        t_run, ticks = time.perf_counter(), cpu_ticks()
        rc, tail = launch_child(run["command"], env)
        record = dict(run=run["run"], pair=run["pair"], mode=run["mode"], command=shlex.join(run["command"]),
                      rc=rc, wall_s=time.perf_counter() - t_run, cpu_steal=steal_fraction(ticks, cpu_ticks()))
        child = None
        if rc == 0:
            try:
                with open(part) as f:
                    child = json.load(f)
                child["modes"][run["mode"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                child, tail = None, f"exit status 0 but no result for {run['mode']} in {part}: {e}"
        if child is None:
            record["error"] = tail or f"exit status {rc}"
            failed.append(record)
            print(f"run {run['run']} ({run['mode']}) failed, exit status {rc}: {record['error']}")
        else:
            record["result"] = child
            for key in ("backend", "device", "jax"):
                result.setdefault(key, child.get(key))
        result["runs"].append(record)
        result.update(aggregate(result["runs"]), wall_s=time.perf_counter() - t_start)
        if preset.get("thirds"):
            result["bars"] = [dataclasses.asdict(v) for v in verdicts(result)]
        _write(result)
    print_repeats(result)
    if OUT.value and any(m in result.get("modes", {}) for m in PLOTTED_MODES):
        plot_acceptance(result["modes"], _acceptance_plot_path(OUT.value))
    if failed:
        print(f"{len(failed)} of {len(order)} runs failed (runs {', '.join(str(r['run']) for r in failed)}); the "
              "others are kept" + (f" in {OUT.value}" if OUT.value else ""))
    return 1 if failed else 0


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def aggregate(runs: list[dict], a: str = "baseline", b: str = "tlt", others: bool = True) -> dict:
    """The figures of the runs so far (records of run_repeats: "run", "pair", "mode", and
    "result" where it finished). `modes`: each mode's first finished run. `pairs`: per pair
    number, `paired_speedups` of its `a` run over its `b` run (the i-th of each by ABBA
    position, never the i-th finished one) or what it misses; `<phase>_speedup`, its
    `_min`, `_max` and `_pairs` over the complete pairs (geometric mean, range, each), and
    the geometric means of `<phase>_speedup_total` and `_of_medians`; with `others`,
    `versus_<a>`: each other mode's speed-ups and `step_of_allowed` against `a`."""
    summary = lambda r: r["result"]["modes"][r["mode"]]
    done = [r for r in runs if "result" in r]
    out = dict(modes={})
    for r in done:
        out["modes"].setdefault(r["mode"], summary(r))
    pairs = []
    for pair in sorted({r["pair"] for r in runs}):
        members = {r["mode"]: r for r in runs if r["pair"] == pair}
        if a not in members or b not in members:
            continue
        ra, rb = members[a], members[b]
        entry = {"pair": pair, f"{a}_run": ra["run"], f"{b}_run": rb["run"],
                 "first": a if ra["run"] < rb["run"] else b}
        missing = [f"run {r['run']} ({r['mode']})" for r in (ra, rb) if "result" not in r]
        if missing:
            entry["missing"] = ", ".join(missing) + " failed"
        else:
            sa, sb = summary(ra), summary(rb)
            try:
                entry.update(paired_speedups(sa, sb))
            except ValueError as e:
                entry["missing"] = str(e)
            else:
                for key, name in _SPEEDUPS:
                    if f"{name}_speedup" in entry:
                        entry[f"{name}_speedup_of_medians"] = sa["median"][key] / sb["median"][key]
        pairs.append(entry)
    out["pairs"] = pairs
    complete = [p for p in pairs if "missing" not in p]
    if others:
        out.update(drafter_comparisons(done))
    if not complete:
        return out
    out["pairs_complete"] = len(complete)
    for name in [n for _, n in _SPEEDUPS if all(f"{n}_speedup" in p for p in complete)]:
        ratios = [p[f"{name}_speedup"] for p in complete]
        out.update({f"{name}_speedup": _geomean(ratios), f"{name}_speedup_min": min(ratios),
                    f"{name}_speedup_max": max(ratios), f"{name}_speedup_pairs": ratios,
                    f"{name}_speedup_total": _geomean([p[f"{name}_speedup_total"] for p in complete]),
                    f"{name}_speedup_of_medians": _geomean([p[f"{name}_speedup_of_medians"] for p in complete])})
    of_allowed = [p["step_of_allowed"] for p in complete]
    out.update(step_of_allowed=_geomean(of_allowed), step_of_allowed_min=min(of_allowed),
               step_of_allowed_max=max(of_allowed))
    medians = lambda mode, key: statistics.median(summary(r)["median"][key] for r in done if r["mode"] == mode)
    out.update(rollout_time_s={m: medians(m, "time_rollout_s") for m in (a, b)},
               step_time_s={m: medians(m, "time_step_s") for m in (a, b)})
    if b == "tlt":
        out["acceptance_length"] = out["modes"]["tlt"].get("acceptance_length")
    out["final_eval_accuracy"] = {m: out["modes"][m].get("final_eval_accuracy") for m in (a, b)}
    # With `others`, every other mode (frozen, ngram, history) against `a` the same way.
    keys = [f"{x}{y}" for x in ("rollout_speedup", "step_speedup", "step_of_allowed") for y in ("", "_min", "_max")]
    for other in sorted({r["mode"] for r in runs} - {a, b}) if others else ():
        versus = aggregate(runs, a, other, others=False)
        if "pairs_complete" in versus:
            out.setdefault(f"versus_{a}", {})[other] = {k: versus[k] for k in keys}
    return out


def drafter_comparisons(done: list[dict], stale: str = "frozen") -> dict:
    """Each trained drafter's mode ("tlt", "scratch") against the `stale` one of the same
    pair, over the last third of the steps: acceptance length and rollout tokens/s (unless
    coupled, the modes sample different tokens once their drafters differ, so their steps'
    times compare unlike work; tokens/s does not), and the steps both sampled alike.
    `<mode>_versus_<stale>`: per pair and the geometric mean over pairs of each ratio."""
    out = {}
    last = lambda r, key: (r["result"]["modes"][r["mode"]].get("thirds", {}).get(key) or {}).get("last")
    for mode in sorted({r["mode"] for r in done} & {"tlt", "scratch"}):
        pairs = []
        for pair in sorted({r["pair"] for r in done}):
            members = {r["mode"]: r for r in done if r["pair"] == pair}
            if mode not in members or stale not in members:
                continue
            ratio = {}
            for key in ("acceptance_length", "rollout_tokens_per_s"):
                x, y = last(members[mode], key), last(members[stale], key)
                if x and y:
                    ratio[key] = x / y
            if ratio:
                digests = [members[m]["result"]["modes"][m].get("samples_digest") or [] for m in (mode, stale)]
                # Steps on which both drew the very same samples: all of them when coupled, so the
                # ratios compare drafters on one trajectory of the policy.
                same = sum(a is not None and a == b for a, b in zip(*digests))
                pairs.append(dict(pair=pair, **ratio, same_samples_steps=same))
        if pairs:
            entry = dict(pairs=pairs)
            for key in ("acceptance_length", "rollout_tokens_per_s"):
                values = [p[key] for p in pairs if key in p]
                if values:
                    entry[f"{key}_last_third"] = _geomean(values)
                    entry[f"{key}_last_third_min"], entry[f"{key}_last_third_max"] = min(values), max(values)
            out[f"{mode}_versus_{stale}"] = entry
    return out


def print_repeats(result: dict) -> None:
    preset = PRESETS[result["preset"]]
    layers = result.get("layers", preset["layers"])
    print(f"\nbackend {result.get('backend')}, preset {result['preset']} ({layers}-layer target), seed "
          f"{result['seed']}, {result['steps']} steps per run, each run a fresh process ({result['wall_s'] / 60:.1f} "
          f"min in all); {_timed_steps(preset, result['steps'])}")
    rows = [(f"{r['run']:3}{r['pair']:5}  {r['mode']:9}",
             r["result"]["modes"][r["mode"]] if "result" in r else f"   failed (exit status {r['rc']})")
            for r in result["runs"]]
    _print_table(rows, f"{'run':>3}{'pair':>5}  {'mode':9}")
    _print_rewards(result, [(f"run {r['run']} ({r['mode']})", r["result"]["modes"][r["mode"]])
                            for r in result["runs"] if "result" in r])
    _print_rollout_split([(f"run {r['run']} ({r['mode']})", r["result"]["modes"][r["mode"]])
                          for r in result["runs"] if "result" in r])
    steal = [(r["run"], r.get("cpu_steal")) for r in result["runs"]]
    if any(v is not None for _, v in steal):
        print("CPU time stolen by the hypervisor during each run: " + ", ".join(
            f"run {run} {'?' if v is None else f'{v:.1%}'}" for run, v in steal))
    for p in result.get("pairs", []):
        if "missing" in p:
            print(f"pair {p['pair']}: no ratio ({p['missing']})")
        else:
            decode = f"decode {p['decode_speedup']:.2f}x, " if "decode_speedup" in p else ""
            print(f"pair {p['pair']} ({p['first']} first): {decode}rollout {p['rollout_speedup']:.2f}x, step "
                  f"{p['step_speedup']:.2f}x (medians of the per-step ratios), {p['step_of_allowed']:.2f}x of what "
                  f"each step's rollout allows (median {p['step_allowed']:.2f}x; the baseline's rollout share "
                  f"{p['baseline_rollout_share']:.0%}); "
                  "ratio of sums: rollout "
                  f"{p['rollout_speedup_total']:.2f}x, step {p['step_speedup_total']:.2f}x")
    if "rollout_speedup" in result:
        n = result["pairs_complete"]
        if "decode_speedup" in result:
            print(f"decode speed-up (the decode chunks alone) {result['decode_speedup']:.2f}x (min "
                  f"{result['decode_speedup_min']:.2f}x, max {result['decode_speedup_max']:.2f}x)")
        print(f"rollout speed-up {result['rollout_speedup']:.2f}x (min {result['rollout_speedup_min']:.2f}x, max "
              f"{result['rollout_speedup_max']:.2f}x), step speed-up {result['step_speedup']:.2f}x (min "
              f"{result['step_speedup_min']:.2f}x, max {result['step_speedup_max']:.2f}x): geometric means over "
              f"{n} pair{'s' * (n != 1)} of the medians of the per-step ratios")
        print(f"the step is {result['step_of_allowed']:.2f}x (min {result['step_of_allowed_min']:.2f}x, max "
              f"{result['step_of_allowed_max']:.2f}x) of what its rollout allows, all else equal (per step: the "
              "baseline's step with TLT's rollout, over TLT's step; geometric mean over the pairs of the medians)")
        for mode, v in result.get("versus_baseline", {}).items():
            print(f"{mode} against the baseline of its pair: rollout {v['rollout_speedup']:.2f}x (min "
                  f"{v['rollout_speedup_min']:.2f}x, max {v['rollout_speedup_max']:.2f}x), step "
                  f"{v['step_speedup']:.2f}x (min {v['step_speedup_min']:.2f}x, max {v['step_speedup_max']:.2f}x), "
                  f"the step {v['step_of_allowed']:.2f}x of what its rollout allows")
        print(f"ratio of sums: rollout {result['rollout_speedup_total']:.2f}x, step "
              f"{result['step_speedup_total']:.2f}x; ratio of the medians: rollout "
              f"{result['rollout_speedup_of_medians']:.2f}x, step {result['step_speedup_of_medians']:.2f}x "
              "(geometric means over the pairs)")
    _print_drafter_comparisons(result)
    if preset.get("thirds"):
        print_verdicts(result)
    _warn_compiles({f"run {r['run']} ({r['mode']})": r["result"]["modes"][r["mode"]]["new_compiled_programs"]
                    for r in result["runs"] if "result" in r})


def paired_speedups(baseline: dict, tlt: dict) -> dict:
    """Speed-ups over the same steps (the same prompts in both modes): `<phase>_speedup`, the
    median of the per-step ratios, and `<phase>_speedup_total`, the ratio of the summed
    times. Sturdier than a ratio of medians: a step's learner time jumps with the packed rows
    its longest answers need, so each mode's median can land on a different side of a jump."""
    if baseline["steady_steps"] != tlt["steady_steps"]:
        raise ValueError("The modes timed different steps; run them with the same --steps.")
    out = {}
    for key, name in _SPEEDUPS:
        if key not in baseline["steady_times"] or key not in tlt["steady_times"]:
            continue  # a result from before decode was recorded apart
        b, t = baseline["steady_times"][key], tlt["steady_times"][key]
        if min(b + t) <= 0:
            continue
        out[f"{name}_speedup"] = statistics.median(x / y for x, y in zip(b, t))
        out[f"{name}_speedup_total"] = sum(b) / sum(t)
    # What the step could gain if TLT changed nothing but the rollout (Amdahl), step by step:
    # the baseline's step with TLT's rollout in place of its own, 1 / ((1 - share) + share /
    # rollout ratio) with that step's share and ratio. `step_of_allowed`, the median over steps
    # of that step over TLT's, falls below 1 by what TLT adds outside the rollout (the bar asks
    # for 0.95). Per step, as the speed-ups are: the medians of two per-step ratios and a share
    # of sums do not compose (a step's rollout ratio and share move together).
    b_step, b_rollout = baseline["steady_times"]["time_step_s"], baseline["steady_times"]["time_rollout_s"]
    t_step, t_rollout = tlt["steady_times"]["time_step_s"], tlt["steady_times"]["time_rollout_s"]
    with_tlt_rollout = [s - r + tr for s, r, tr in zip(b_step, b_rollout, t_rollout)]
    out.update(baseline_rollout_share=sum(b_rollout) / sum(b_step),
               step_allowed=statistics.median(s / w for s, w in zip(b_step, with_tlt_rollout)),
               step_of_allowed=statistics.median(w / t for w, t in zip(with_tlt_rollout, t_step)),
               step_of_allowed_total=sum(with_tlt_rollout) / sum(t_step))
    return out


def _acceptance_plot_path(out: str) -> str:
    """Where `plot_acceptance` draws beside the JSON of --out."""
    return os.path.splitext(out)[0] + "_acceptance.png"


def plot_acceptance(modes: dict, path: str) -> None:
    """Per RL step of each drafter the modes ran (adaptive, frozen, from nothing, n-gram):
    the live acceptance length, with the policy's KL from its start on a second axis; and
    the teacher-forced acceptance of the drafter that served the step on the step's own
    sequences (which does not mix in the arms the tuner chose), with the run's starting
    drafter on the same sequences (dashed: how stale it would be by now); below, each mode's
    eval accuracy at its eval steps."""
    from matplotlib.figure import Figure

    labels = {"tlt": "adaptive (spot-trained)", "frozen": "frozen at step 0", "scratch": "adaptive, from nothing",
              "ngram": "none (n-gram only)"}
    nan_for_none = lambda xs: [float("nan") if x is None else x for x in xs]
    figure = Figure(figsize=(7, 7.6), layout="constrained")
    live, served, evals = figure.subplots(3, 1, sharex=True, height_ratios=(3, 3, 2))
    kl_axis = None
    for i, (mode, label) in enumerate((m, l) for m, l in labels.items() if m in modes):
        color = f"C{i}"
        # A step whose tail chunks all decoded plainly has no acceptance: a gap, not 0.
        values = [a if a > 0 else float("nan") for a in modes[mode]["acceptance_length"]]
        live.plot(range(1, len(values) + 1), values, marker="o", markersize=3, color=color, label=label)
        rates = nan_for_none(modes[mode].get("served_accept_rate", []))
        if any(not math.isnan(a) for a in rates):
            served.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, color=color, label=label)
        initial = nan_for_none(modes[mode].get("initial_accept_rate", []))
        if mode != "frozen" and any(not math.isnan(a) for a in initial):
            served.plot(range(1, len(initial) + 1), initial, linestyle="--", color=color,
                        label=f"{label}: its starting drafter")
        kl = nan_for_none(modes[mode].get("policy_kl_from_start", []))
        if any(not math.isnan(k) for k in kl):
            kl_axis = kl_axis or live.twinx()
            kl_axis.plot(range(1, len(kl) + 1), kl, linestyle=":", color=color, label=f"{label}: policy KL")
    # Greedy eval accuracy on held-out problems, the learning the drafters are compared on (one
    # line per mode: coupled modes overlap, having drawn the same samples).
    for i, (mode, m) in enumerate(modes.items()):
        if m.get("eval_steps") and m.get("eval_accuracy"):
            evals.plot(m["eval_steps"], m["eval_accuracy"], marker="s", markersize=4, color=f"C{i}",
                       linestyle="-" if i == 0 else "--", label=mode)
    live.set_ylabel("acceptance length (live)")
    served.set_ylabel("first-draft acceptance,\nteacher-forced")
    evals.set_ylabel("eval accuracy")
    evals.set_xlabel("RL step")
    if kl_axis is not None:
        kl_axis.set_ylabel("policy KL from its start (dotted)")
        kl_axis.legend(loc="lower right", fontsize="small")
    for ax in (live, served, evals):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    figure.savefig(path, dpi=100)


def xla_cache_dir() -> str:
    return os.path.abspath(os.path.join(CACHE.value, "xla"))


def cached_programs() -> int:
    """Programs in the benchmark's persistent compilation cache (every compile is kept)."""
    path = xla_cache_dir()
    return len(os.listdir(path)) if os.path.isdir(path) else 0


def _write(result):
    if OUT.value:
        machine.write_result(OUT.value, result)


if __name__ == "__main__":
    launch.run(main)
