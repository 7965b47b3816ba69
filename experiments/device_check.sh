#!/usr/bin/env bash
# GPU checks for the device machine, run from anywhere:  OUT=/some/dir bash experiments/device_check.sh
#
# Blocks run in the order of what is least measured: spec, tlt (reuses spec's target and
# drafter), rollout, attention, verify, losses. BLOCKS picks them, e.g.
# BLOCKS="rollout attention" bash experiments/device_check.sh. The default BLOCKS ("spec tlt")
# fit 8 minutes on the H200 by their own timeouts: spec 240 s + tlt 205 s + 35 s of setup
# and summary = 480 s (`PLAN=1 bash experiments/device_check.sh` prints each command's
# timeout and the sum, and runs nothing). The rest run by name: drift 300 s (after spec),
# drift_learn 420 s, agents 400 s (after spec), offpolicy 90 s (after spec), rollout 130 s, attention 115 s, verify 60 s, losses 185 s,
# distill32k 180 s.
#
# Each command runs under its own `timeout` (SIGTERM: nothing here handles it, so a process
# stops at once) and must not stop the blocks after it (no `set -e`). Every benchmark
# rewrites its JSON after every case (bench_tlt after every run), so a block cut short keeps
# what it finished. Each block ends with one exit line, "block NAME: ok (N s)", or
# "block NAME: timeout (...)" / "block NAME: FAIL (...)" naming the first command that did
# not exit 0. The script ends with one table, every bar of DESIGN.md section 5 against what
# the blocks measured (experiments/device_summary.py; also $OUT/summary.json and summary.txt).
# PYTHON names the interpreter every command runs under (default: python from PATH).
# $OUT then holds summary.txt, summary.json, device_check.tgz (every log and JSON; PACK=0
# keeps them loose too), rollout_hlo.tgz and, from the verify and losses blocks,
# impl_table.json (loose: the rows impl="auto" reads, merged into the shipped table with
# `python -m tlt_jax.impl_table --merge impl_table.json`): under the device machine's 8 files.
#
# DRY=1 runs every block's commands on the CPU (the same launchers and flags at tiny sizes
# and a few steps; all blocks unless BLOCKS says otherwise; OUT defaults to a new temporary
# directory; each command gets DRY_TIMEOUT seconds, 300 unless set). Where a path exists only
# on a GPU (nvidia-smi, Triton lowering of the Pallas kernels, cuDNN attention, device memory
# stats) the log says "DRY: ..." and what runs in its place. tests/experiments/test_device_check.py runs it.
set -u
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python}  # the tests pass their own: a venv's need not be the one on PATH
DRY=${DRY:-0}
PLAN=${PLAN:-0}
dry() { [[ $DRY != 0 ]]; }
plan() { [[ $PLAN != 0 ]]; }
if dry; then
  BLOCKS=${BLOCKS:-"spec tlt rollout attention verify losses distill32k"}
  DRY_TIMEOUT=${DRY_TIMEOUT:-300}
  if [[ -z ${OUT:-} ]]; then
    if plan; then OUT=/tmp/device_check_dry; else OUT=$(mktemp -d /tmp/device_check_dry.XXXXXX); fi
  fi
  PACK=${PACK:-0}
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
else
  BLOCKS=${BLOCKS:-"spec tlt"}
  OUT=${OUT:-/tmp/device_check}
  PACK=${PACK:-1}
fi
want() { [[ " $BLOCKS " == *" $1 "* ]]; }
note() { echo "DRY: $*"; }  # a GPU-only path and what the dry run does in its place
PLANNED=0
FAILED=""

# step NAME TIMEOUT_S LOG CMD...: CMD under its timeout (DRY_TIMEOUT in a dry run), stdout and
# stderr to LOG, then "NAME exit RC" appended to LOG; the block's first failure is kept.
step() {
  local name=$1 limit=$2 log=$3 rc
  shift 3
  dry && limit=$DRY_TIMEOUT
  PLANNED=$((PLANNED + limit))
  if plan; then
    printf '%6d s  %-22s %s\n' "$limit" "$name" "$*"
    return 0
  fi
  timeout "$limit" "$@" > "$log" 2>&1
  rc=$?
  echo "$name exit $rc" >> "$log"
  if ((rc != 0)) && [[ -z $BLOCK_FAIL ]]; then
    if ((rc == 124)); then BLOCK_FAIL="timeout ($name stopped at its ${limit} s"
    elif ((rc == 137)); then BLOCK_FAIL="FAIL ($name killed (SIGKILL: out of memory?), see $(basename "$log")"
    else BLOCK_FAIL="FAIL ($name exit $rc, see $(basename "$log")"; fi
  fi
  return $rc
}
block_start() {
  BLOCK=$1 BLOCK_FAIL="" BLOCK_T0=$SECONDS
  plan && echo "block $1:" || echo "== block $1"
}
# block_end JSON...: the block's exit line; a JSON it should have written and did not is a failure.
block_end() {
  plan && return 0
  local json
  for json in "$@"; do
    [[ -s $json ]] || BLOCK_FAIL=${BLOCK_FAIL:-"FAIL (no $(basename "$json")"}
  done
  if [[ -z $BLOCK_FAIL ]]; then
    echo "block $BLOCK: ok ($((SECONDS - BLOCK_T0)) s)"
  else
    echo "block $BLOCK: $BLOCK_FAIL; kept what finished; $((SECONDS - BLOCK_T0)) s)"
    FAILED="$FAILED $BLOCK"
  fi
}

plan || mkdir -p "$OUT"
plan && echo "plan for BLOCKS=\"$BLOCKS\"$(dry && echo ' (DRY)'), OUT=$OUT: timeout per command"
dry && ! plan && note "tiny sizes on the CPU (JAX_PLATFORMS=cpu), OUT=$OUT, $DRY_TIMEOUT s per command"
BLOCK_FAIL=""
# Without ml-collections (every config file needs it) and without a package index, the
# wheel comes along in .whl/: `python -m pip download --no-deps -d .whl ml-collections==1.1.0`.
if plan || ! "$PYTHON" -c "import ml_collections" 2>/dev/null; then  # the plan counts it: the GPU machine has none
  step pip 10 "$OUT/pip.log" "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    || echo "no ml_collections wheel in .whl/"
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if dry; then
  note "nvidia-smi skipped (no GPU); gpu.csv says so"
  plan || echo "DRY: no GPU, the CPU: $(nproc) cores" > "$OUT/gpu.csv"
else
  step nvidia-smi 5 "$OUT/gpu.csv" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
step versions 15 "$OUT/versions.txt" "$PYTHON" -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())"

# ===== BEGIN spec: speculative vs plain rollouts (sft.py, train_drafter.py, bench_spec.py) =====
# Budget: 240 s. Trains the 180M-parameter target of configs/sft.py:gpu on the addition
# traces (float32 masters, bfloat16 compute), then its one-layer drafter, then plain vs an
# 8-deep EAGLE chain at temperature 1 (the bars: speed-up >= 2.5x at batch <= 8, acceptance
# >= 4; on the CPU's wide regime eagle-d8 beat eagle-d6 at batch 1-4), bfloat16, batch 1,
# then 8 if the budget lets it start. Seen on the H200
# (2026-12-04): SFT's 500 steps take 43 s (35 steps/s after a 12 s first step) and the whole
# process ~90 s; the drafter's 600 steps 28 s after a 16 s first step. Each batch size
# compiles its own steps (tens of seconds for 16 unrolled layers); the other strategies,
# batch sizes and temperature 0 are for a run of their own:
#   BLOCKS=spec SPEC_ARGS="--strategies=eagle-d6,eagle-d4,eagle-d5-k3-t12,ngram-d4-b2 --temperatures=0,1"
# The efficiency bars (measured / ideal speed-up: >= 0.85 at batch 1-8, >= 0.75 at 32-64) need
# the breakdown, which compiles 4 more programs per batch size and times each for a second (at
# batches 1,8 it had printed nothing after 85 s on the H200: give it a run of its own):
#   BLOCKS=spec SPEC_ARGS="--strategies=eagle-d8 --temperatures=1 --breakdown --batches=1,32"
if want spec; then
  block_start spec
  if dry; then
    note "spec: the gpu presets (float32 masters, bfloat16 compute) at 2 layers of 64 and 2 steps, the drafter" \
      "without acceptance rollouts; bench_spec --preset=cpu with eagle-d3 at batch 1 (8 left to the time budget);" \
      "spec_verify impl=auto" \
      "is the jnp reference on the CPU"
    SFT=(--config=configs/sft.py:gpu --config.model.num_layers=2 --config.model.hidden_size=64
      --config.model.intermediate_size=128 --config.model.head_dim=16 --config.model.num_heads=4
      --config.model.num_kv_heads=2 --config.steps=2 --config.eval_every=2
      --config.checkpoint_every=2 --config.data.num_train=256 --config.data.num_eval=8 --config.eval.num_slots=8)
    DRAFTER=(--config=configs/drafter.py:gpu --config.acceptance.num_prompts=0
      --config.steps=2 --config.eval_every=2 --config.checkpoint_every=2 --config.data.num_train=256
      --config.data.num_eval=16 --config.eval_batch_size=8)
    SPEC=(--preset=cpu --batches=1,8 --time_budget_s=1)
    SPEC_STRATEGY=eagle-d3  # a chain 3 deep compiles in less than half eagle-d8's time; the same code path
  else
    SFT=(--config=configs/sft.py:gpu --config.data.num_eval=32)
    # No acceptance rollouts after training (the 16 prompts' did not finish in 70 s on the
    # H200, 2026-12-04): bench_spec and bench_tlt measure acceptance.
    DRAFTER=(--config=configs/drafter.py:gpu --config.acceptance.num_prompts=0)
    SPEC=(--preset=gpu --batches=1,8 --time_budget_s=30)
    SPEC_STRATEGY=eagle-d8
  fi
  step sft 100 "$OUT/sft.log" "$PYTHON" -m experiments.sft "${SFT[@]}" --config.run_dir="$OUT/sft_gpu"
  step train_drafter 55 "$OUT/train_drafter.log" "$PYTHON" -m experiments.train_drafter "${DRAFTER[@]}" \
    --config.target_dir="$OUT/sft_gpu/hf" --config.run_dir="$OUT/drafter_gpu"
  # shellcheck disable=SC2086  # SPEC_ARGS is a list of flags
  step bench_spec 85 "$OUT/bench_spec.log" "$PYTHON" -m experiments.bench_spec "${SPEC[@]}" --target="$OUT/sft_gpu/hf" \
    --drafter="$OUT/drafter_gpu/drafter" --dtype=bfloat16 ${SPEC_ARGS:---strategies=$SPEC_STRATEGY --temperatures=1} \
    --out="$OUT/bench_spec.json"
  if ! plan; then
    tail -n 3 "$OUT/sft.log" "$OUT/train_drafter.log"
    tail -n 8 "$OUT/bench_spec.log"
    rm -rf "$OUT/sft_gpu/checkpoints" "$OUT/drafter_gpu/checkpoints"  # the tlt block reuses hf/ and drafter/
  fi
  block_end "$OUT/bench_spec.json"
fi
# ===== END spec ===================================================================================

# ===== BEGIN tlt: TLT against the baseline end to end (bench_tlt.py) ==========================
# Budget: 205 s. The spec block's 180M target and drafter (run it first): the same RL run with
# TLT off and on, each mode in a fresh process (one pair; TLT_ARGS=--repeats=2 for ABBA, on
# request). On the H200 (2026-12-04) the preset's former 32 prompts x 8 samples gave a
# baseline run of 82 s (32 s compiling) whose rollout was 37% of its step, and the TLT run
# did not finish in 180 s: the preset is now 2 prompts x 8 samples, one update per step.
# Bars (DESIGN.md section 5): step_speedup >= 2.5 on a preset whose baseline rollout is >= 90% of its
# step (FastGRPO's traces: 91-98%; TLT: 1.7-2.1x vs verl), acceptance >= 4 at temperature 1,
# eval accuracy within seed noise.
if want tlt; then
  block_start tlt
  # Few programs to compile (each a 16-layer unrolled decode on the GPU): attention over
  # every kv slot (the answers are short) and three arms in one bucket, not the default
  # tuner's seven strategies over three buckets, each compiled per kv bucket.
  TLT=(--preset=gpu --set=rollout.kv_bucket=0 --tlt_set=tlt.tuner.buckets=[1]
       "--tlt_set=tlt.tuner.arms=[['eagle-d8','eagle-d6','plain']]")
  if dry; then
    note "tlt: bench_tlt --preset=gpu as on the GPU, 1 step per run, on the spec block's tiny target; 16 eval" \
      "prompts, drafter batches of 1 row (the warm-up compiles a drafter step per power of two up to the batch);" \
      "arms eagle-d3 and plain (a shallower chain compiles faster; one chain, since each compiles on its first pick)"
    TLT+=(--steps=1 --set=data.num_eval=16 --tlt_set=tlt.drafter.batch_size=1
          "--tlt_set=tlt.tuner.arms=[['eagle-d3','plain']]")
  fi
  if ! plan && [[ ! -d $OUT/sft_gpu/hf || ! -d $OUT/drafter_gpu/drafter ]]; then
    BLOCK_FAIL="FAIL (no target in $OUT/sft_gpu/hf or drafter in $OUT/drafter_gpu/drafter: run the spec block first"
  else
    # shellcheck disable=SC2086  # TLT_ARGS is a list of flags
    step bench_tlt 205 "$OUT/bench_tlt.log" "$PYTHON" -m experiments.bench_tlt "${TLT[@]}" ${TLT_ARGS:---repeats=1} \
      --target="$OUT/sft_gpu/hf" --drafter="$OUT/drafter_gpu/drafter" --run_dir="$OUT/bench_tlt_runs" \
      --cache_dir="$OUT/bench_tlt_cache" --out="$OUT/bench_tlt.json"
    plan || tail -n 8 "$OUT/bench_tlt.log"
  fi
  plan || rm -rf "$OUT/bench_tlt_runs" "$OUT/bench_tlt_cache"
  block_end "$OUT/bench_tlt.json"
fi

# ----- drift (by name: BLOCKS="spec tlt drift"): the spot-trained drafter against the frozen one
# Budget: 300 s, beyond the default 8-minute plan. The spec block's target and drafter, the
# gpu preset's shape with the policy's learning rate at 2e-4 (the CPU drift presets'), 30 RL
# steps of each of tlt and frozen in fresh processes (one pair), the tuner pinned to eagle-d6
# so that live acceptance compares drafters. It answers: does the policy move
# (policy_kl_from_start), does the frozen drafter go stale (its live acceptance and the
# starting drafter's teacher-forced rate, first against last third), and does TLT hold
# (tlt_versus_frozen: acceptance and rollout tokens/s over the last third). Coupled, as the CPU
# drift presets: both modes draw the same samples (same_samples_steps), so rollout tokens/s
# compares like work; the warm start trains by the CPU drift presets' recipe (rate 3e-4, 8
# catch-up steps an RL step, the scored publish).
if want drift; then
  block_start drift
  DRIFT=(--preset=gpu --modes=tlt,frozen --pin_arm=eagle-d6 --set=rollout.kv_bucket=0
         --set=learner.optimizer.learning_rate=2e-4 --steps=30 --set=rollout.spec_coupled=True
         --tlt_set=tlt.drafter.optimizer.learning_rate=3e-4 --tlt_set=tlt.spot.catch_up_steps=8
         --tlt_set=tlt.spot.catch_up_max_share=1.0 --tlt_set=tlt.drafter.publish_scored=True)
  dry && DRIFT=(--preset=gpu --modes=tlt,frozen --pin_arm=eagle-d4 --set=learner.optimizer.learning_rate=2e-4 --steps=2)
  if ! plan && [[ ! -d $OUT/sft_gpu/hf || ! -d $OUT/drafter_gpu/drafter ]]; then
    BLOCK_FAIL="FAIL (no target in $OUT/sft_gpu/hf or drafter in $OUT/drafter_gpu/drafter: run the spec block first"
  else
    # shellcheck disable=SC2086  # DRIFT_ARGS is a list of flags
    step bench_tlt_drift 300 "$OUT/bench_tlt_drift.log" "$PYTHON" -m experiments.bench_tlt "${DRIFT[@]}" \
      ${DRIFT_ARGS:---repeats=1} --target="$OUT/sft_gpu/hf" --drafter="$OUT/drafter_gpu/drafter" \
      --run_dir="$OUT/bench_tlt_drift_runs" --cache_dir="$OUT/bench_tlt_cache" --out="$OUT/bench_tlt_drift.json"
    plan || tail -n 8 "$OUT/bench_tlt_drift.log"
  fi
  plan || rm -rf "$OUT/bench_tlt_drift_runs" "$OUT/bench_tlt_cache"
  block_end "$OUT/bench_tlt_drift.json"
fi

# ----- drift_learn (by name: BLOCKS=drift_learn): the adaptive drafter's speed where the policy learns
# Budget: 420 s, on its own (no other block needed; the script's setup makes it about 450 s).
# cpu_drift_learn as shipped (assets/sft_drift_learn deepened to 16 layers, its offline drafter
# assets/drafter_drift_learn, 60 RL steps in which greedy eval accuracy climbs from 0.016 to
# about 0.96 while the responses switch format), tlt then frozen, each in a fresh process,
# coupled (both draw the same samples), the tuner pinned to eagle-d6. A 1M-parameter target is
# launch-bound on a GPU, so decode's MLPs are padded with zero units to DRIFT_LEARN_MLP (81920:
# 2.0 GB of float32 weights over 16 layers of width 128, about 0.4 ms a step at 4.8 TB/s; the
# same tokens), and the regime check times plain decode at batch 1, 2 and 4 on the GPU. It must
# confirm: the regime check passes (a decode step bound by reading the weights); the bars'
# lines at the end of bench_tlt_drift_learn.log: TLT's live acceptance >= 1.3x frozen's over
# the last third, frozen's fall >= 20%, the same samples at every step, and the one bar only a
# weight-bound machine can show, TLT's rollout tokens/s >= 1.2x frozen's over the last third.
if want drift_learn; then
  block_start drift_learn
  DRIFT_LEARN=(--preset=cpu_drift_learn --modes=tlt,frozen --repeats=1 --decode_mlp_size="${DRIFT_LEARN_MLP:-81920}")
  dry && DRIFT_LEARN=(--preset=cpu_drift_learn --modes=tlt,frozen --repeats=1 --steps=9 --decode_mlp_size=0
                      --noregime_check)
  step bench_tlt_drift_learn 420 "$OUT/bench_tlt_drift_learn.log" "$PYTHON" -m experiments.bench_tlt \
    "${DRIFT_LEARN[@]}" --run_dir="$OUT/bench_tlt_drift_learn_runs" --cache_dir="$OUT/bench_tlt_cache" \
    --out="$OUT/bench_tlt_drift_learn.json"
  plan || tail -n 10 "$OUT/bench_tlt_drift_learn.log"
  plan || rm -rf "$OUT/bench_tlt_drift_learn_runs" "$OUT/bench_tlt_cache"
  block_end "$OUT/bench_tlt_drift_learn.json"
fi

# ----- agents (by name: BLOCKS="spec agents"): TLT on multi-turn rollouts with environment steps
# Budget: 400 s, beyond the default 8-minute plan. The spec block's target and drafter,
# bench_tlt --preset=gpu_env: the gpu preset's shape, 3 turns a sample, each turn ended by an
# environment step that sleeps 20 ms (experiments/scripted_env.py), one pair of baseline and
# TLT runs with the environments overlapped with decoding, then one with decoding stopped for
# them (--noenv_overlap); 6 steps a run. Bars: decode_speedup (the decode chunks
# alone: TLT cannot shorten an environment's latency) >= 1.5, step_of_allowed >= 0.95, eval
# accuracy within seed noise. AGENTS_ARGS adds flags to both runs (e.g. --env_latency_ms=50).
if want agents; then
  block_start agents
  AGENTS=(--preset=gpu_env --set=rollout.kv_bucket=0 --tlt_set=tlt.tuner.buckets=[1]
          "--tlt_set=tlt.tuner.arms=[['eagle-d8','eagle-d6','plain']]" --steps=6)
  if dry; then
    note "agents: bench_tlt --preset=gpu_env as on the GPU, 1 step per run, 1 ms a step, on the spec block's" \
      "tiny target"
    AGENTS=(--preset=gpu_env --steps=1 --env_latency_ms=1)
  fi
  if ! plan && [[ ! -d $OUT/sft_gpu/hf || ! -d $OUT/drafter_gpu/drafter ]]; then
    BLOCK_FAIL="FAIL (no target in $OUT/sft_gpu/hf or drafter in $OUT/drafter_gpu/drafter: run the spec block first"
  else
    for overlap in env_overlap noenv_overlap; do
      # shellcheck disable=SC2086  # AGENTS_ARGS is a list of flags
      step "bench_tlt_$overlap" 200 "$OUT/bench_tlt_$overlap.log" "$PYTHON" -m experiments.bench_tlt "${AGENTS[@]}" \
        "--$overlap" --repeats=1 ${AGENTS_ARGS:-} --target="$OUT/sft_gpu/hf" --drafter="$OUT/drafter_gpu/drafter" \
        --run_dir="$OUT/bench_tlt_agents_runs" --cache_dir="$OUT/bench_tlt_cache" --out="$OUT/bench_tlt_$overlap.json"
      plan || tail -n 10 "$OUT/bench_tlt_$overlap.log"
    done
  fi
  plan || rm -rf "$OUT/bench_tlt_agents_runs" "$OUT/bench_tlt_cache"
  block_end "$OUT/bench_tlt_env_overlap.json" "$OUT/bench_tlt_noenv_overlap.json"
fi

# ===== BEGIN offpolicy: one-step-off training against synchronous steps (bench_partial.py) =====
# Budget: 90 s, by name after spec (its 180M target): BLOCKS="spec offpolicy" plans 240 + 90 s
# and the setup. The gpu preset's RL run with TLT off, synchronous and one-step-off
# (off_policy_steps=1), each in a fresh process, one pair, 5 steps each (the preset's 3 warm-up
# steps, then 2 timed), the eval on 32 prompts at the start and at step 5. bench_offpolicy.json:
# per run the median step and rollout times, the rollout's share of the step, the learner's
# response tokens/s, the eval accuracy; the pair's ratios (*_off_policy_over_sync). On one GPU
# every program lies on one device, so one-step-off overlaps the next step's rollout with the
# learner there (docs/grpo.md): the ratio is that overlap's gain net of a copy of the weights
# a step, not the gain of a learner and a rollout on two device groups.
if want offpolicy; then
  block_start offpolicy
  OFFPOLICY=(--preset=gpu --against=off_policy --steps=5 --seeds=0 --pairs=1 --set=rollout.kv_bucket=0
             --set=data.num_eval=32 --set=eval_every=5)
  if dry; then
    note "offpolicy: bench_partial --preset=gpu as on the GPU, 4 steps per run (1 timed), on the spec block's" \
      "tiny target, 16 eval prompts"
    OFFPOLICY=(--preset=gpu --against=off_policy --steps=4 --seeds=0 --pairs=1 --set=data.num_eval=16
               --set=eval_every=4)
  fi
  if ! plan && [[ ! -d $OUT/sft_gpu/hf || ! -d $OUT/drafter_gpu/drafter ]]; then
    BLOCK_FAIL="FAIL (no target in $OUT/sft_gpu/hf or drafter in $OUT/drafter_gpu/drafter: run the spec block first"
  else
    step bench_offpolicy 90 "$OUT/bench_offpolicy.log" "$PYTHON" -m experiments.bench_partial "${OFFPOLICY[@]}" \
      --target="$OUT/sft_gpu/hf" --drafter="$OUT/drafter_gpu/drafter" --run_dir="$OUT/bench_offpolicy_runs" \
      --cache_dir="$OUT/bench_tlt_cache" --out="$OUT/bench_offpolicy.json"
    plan || tail -n 8 "$OUT/bench_offpolicy.log"
  fi
  plan || rm -rf "$OUT/bench_offpolicy_runs" "$OUT/bench_tlt_cache"
  block_end "$OUT/bench_offpolicy.json"
fi
plan || rm -rf "$OUT/sft_gpu" "$OUT/drafter_gpu"
# ===== END tlt ================================================================================

# ===== BEGIN rollout: decode throughput vs HBM roofline and transformers (bench_rollout.py) =====
# Budget: 130 s. Qwen2.5-1.5B shape (random bf16 weights), batch 16 and 1, the default decode
# layout (fused, per layer: never measured on the GPU) against the first H200 run's (stacked,
# scanned); transformers' generate (dynamic and static cache) at batch 16. Bar: >= 60% of the
# HBM roofline at batch <= 16.
if want rollout; then
  block_start rollout
  if dry; then
    note "rollout: the tiny model (bench_rollout --preset=cpu) at batch 1 only, the fused layout only (the" \
      "summary reads the first; tests/rollout/test_engine.py decodes every layout alike); the CPU's HLO in" \
      "rollout_hlo.tgz, not the GPU's; transformers on the CPU in float32 (no CUDA)"
    ROLLOUT=(--preset=cpu --models=tiny --batches=1 --hf_batches=1 --layouts=fused)
  else
    ROLLOUT=(--preset=gpu --models=qwen2.5-1.5b --batches=16,1 --hf_batches=16 --layouts=fused,stacked)
  fi
  # The engine's optimized HLO (insert and decode-chunk modules) comes back as
  # rollout_hlo.tgz: which kernels a decode step launches, and any weight or cache copies.
  step bench_rollout 130 "$OUT/bench_rollout.log" env \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/rollout_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_fn" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 "$PYTHON" -m experiments.bench_rollout "${ROLLOUT[@]}" \
    --out="$OUT/bench_rollout.json"
  if ! plan; then
    (cd "$OUT" && find rollout_hlo -name '*after_optimizations.txt' 2>/dev/null | tar czf rollout_hlo.tgz -T -)
    rm -rf "$OUT/rollout_hlo"
    tail -n 8 "$OUT/bench_rollout.log"
  fi
  block_end "$OUT/bench_rollout.json"
fi
# ===== END rollout ==============================================================================

# ===== BEGIN attention: attention memory and time at reasoning lengths (bench_attention.py) =====
# Budget: 115 s. Qwen2.5-1.5B's shapes, bf16, batch 1: agreement of blockwise and cuDNN with
# dense at T=2048, then forward + backward of the attention core at 8k-32k tokens: XLA temp
# bytes (the CPU table's numbers, here from the GPU compiler) and time; dense is expected to
# run out of memory at 32k. Then packed segments (blockwise only: cuDNN's public API has no
# segment ids).
if want attention; then
  block_start attention
  if dry; then
    note "attention: no cuDNN on the CPU: dense and blockwise only; the tiny model's shapes at T=256"
    ATTENTION=(--model=tiny --lengths=256)
  else
    ATTENTION=()
  fi
  step bench_attention 75 "$OUT/bench_attention.log" "$PYTHON" -m experiments.bench_attention --scopes=attention \
    --time --check "${ATTENTION[@]}" --out="$OUT/bench_attention.json"
  step bench_attention_segments 40 "$OUT/bench_attention_segments.log" "$PYTHON" -m experiments.bench_attention \
    --scopes=attention --time --segments --impls=blockwise "${ATTENTION[@]}" \
    --out="$OUT/bench_attention_segments.json"
  plan || tail -n 12 "$OUT/bench_attention.log" "$OUT/bench_attention_segments.log"
  block_end "$OUT/bench_attention.json" "$OUT/bench_attention_segments.json"
fi
# ===== END attention ================================================================================

# ===== BEGIN verify: draft-tree verification, jnp reference vs V-tiled Pallas kernel (bench_verify.py) =====
# Budget: 60 s. Qwen2.5's V = 151936, sampled drafts, first the tlt block's trees (chains of
# 9 and 7 nodes: eagle-d8, eagle-d6), then T = 16 and 48, at batch 1 and 8, until the budget
# stops new cases (the deterministic mode and more block sizes: BLOCKS=verify
# VERIFY_ARGS="--modes=deterministic --block_v=4096"). Each row says whether the kernel's
# outputs equal the reference's; the fastest of the two per B x T x V shape class goes to
# $OUT/impl_table.json (a kernel that disagrees is never chosen), which spec_verify's
# impl="auto" reads once merged into tlt_jax/impl_table.json.
if want verify; then
  block_start verify
  if dry; then
    note "verify: the Pallas kernel in interpret mode (no Triton lowering on the CPU), V=1000"
    VERIFY=(--vocab=1000 --nodes=9,7 --batches=1,8 --repeats=1 --time_budget_s=3)
  else
    VERIFY=(--nodes=9,7,16,48 --batches=1,8 --repeats=5 --time_budget_s=40)
  fi
  # shellcheck disable=SC2086  # VERIFY_ARGS is a list of flags
  step bench_verify 60 "$OUT/bench_verify.log" "$PYTHON" -m experiments.bench_verify "${VERIFY[@]}" \
    ${VERIFY_ARGS:---modes=sampled} --out="$OUT/bench_verify.json" --table="$OUT/impl_table.json"
  plan || tail -n 6 "$OUT/bench_verify.log"
  block_end "$OUT/bench_verify.json"
fi
# ===== END verify =================================================================================

# ===== BEGIN losses: fused linear top-K KL / log-prob (experiments/bench_kl.py) ======
# Budget: 185 s. First 85 s: the dense anchor (for the ratios), then the cases the first run
# did not reach: bf16 dW accumulation at 32k and 256k tokens (the 7 GiB peak bar), the Pallas
# kernels (one fresh process per case; bench_kl.json is rewritten after every case, so an outer
# kill keeps what finished). `--only` dropped, the whole preset takes about 4 minutes;
# LOSSES_ARGS adds flags (a later --only replaces the block's), e.g. BLOCKS=losses
# LOSSES_ARGS=--only=pallas. Then 100 s for impl="auto": chunked_xla and the Pallas kernels at
# the same token counts (8k, 32k; scalar and per-token KL, the log-probs), the faster per shape
# class into $OUT/impl_table.json (bench_kl_table.json has the cases).
if want losses; then
  block_start losses
  if dry; then
    note "losses: bench_kl --preset=cpu, the dense anchor and the fused XLA path at N=4096; the Pallas kernels (fresh" \
      "processes in interpret mode: 45 s of the block's 73 s on 2 cores) are left to the GPU run, and" \
      "tests/test_losses.py checks them in interpret mode; no device memory stats on the CPU, so the 256k" \
      "peak bar reads n/a (XLA temp is measured)"
    LOSSES=(--preset=cpu --only="chunked_xla[dw_accum=param],anchor_dense" --ns=4096)
    # The CPU's only candidate is chunked_xla (the kernel is an interpreter there).
    TABLE=(--preset=cpu --only=chunked_xla --ns=1024)
  else
    LOSSES=(--preset=gpu --only="chunked_xla[dw_accum=param],pallas,anchor_dense")
    TABLE=(--preset=gpu --only=chunked_xla,pallas --ns=8192,32768)
  fi
  # shellcheck disable=SC2086  # LOSSES_ARGS is a list of flags
  step bench_kl 85 "$OUT/bench_kl.log" "$PYTHON" -m experiments.bench_kl "${LOSSES[@]}" --time_budget_s=55 \
    ${LOSSES_ARGS:-} --out="$OUT/bench_kl.json"
  plan || tail -n 12 "$OUT/bench_kl.log"
  step bench_kl_table 100 "$OUT/bench_kl_table.log" "$PYTHON" -m experiments.bench_kl "${TABLE[@]}" \
    --time_budget_s=70 --out="$OUT/bench_kl_table.json" --table="$OUT/impl_table.json"
  plan || tail -n 6 "$OUT/bench_kl_table.log"
  block_end "$OUT/bench_kl.json" "$OUT/bench_kl_table.json"
fi
# ===== END losses ====================================================================

# ===== BEGIN distill32k: one real update of the 3.2B student at 32k tokens (plan_memory --execute) =====
# Budget: 180 s, by name (BLOCKS=distill32k), beyond the default 8-minute plan: 215 s with the
# setup and summary. configs/distill.py:llama3-8b-to-3b-32k's student step (Llama-3.2-3B shape,
# random bf16 weights, one row of 32,768 tokens, a top-100 bfloat16 cache row, remat per layer)
# compiled by the GPU and run once; the JSON holds the GPU's compile-time total beside the
# device's measured peak (memory_stats) and the CPU plan's total from
# docs/results/plan_distill_llama3.2-3b_32k_h200.json. Bar: the peak fits the H200's 141 GB.
# Never run on a GPU yet: the compile of 28 remat layers at 32k is the unknown in the budget.
if want distill32k; then
  block_start distill32k
  if dry; then
    note "distill32k: the tiny preset at 256 tokens on the CPU: no device memory stats, the measured peak reads n/a"
    DISTILL32K=(--presets=tiny --seq_lens=256)
  else
    DISTILL32K=(--backend=gpu --presets=llama3.2-3b --seq_lens=32768
                --planned=docs/results/plan_distill_llama3.2-3b_32k_h200.json)
  fi
  step plan_distill_32k 180 "$OUT/plan_distill_32k.log" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    "$PYTHON" -m experiments.plan_memory --steps=distill --execute "${DISTILL32K[@]}" --out="$OUT/plan_distill_32k.json"
  plan || tail -n 3 "$OUT/plan_distill_32k.log"
  block_end "$OUT/plan_distill_32k.json"
fi
# ===== END distill32k ===============================================================================

# ===== The bars against their targets: one table (experiments/device_summary.py) =====
PLANNED=$((PLANNED + 5))
if plan; then
  printf '%6d s  %-22s %s\n' 5 summary "$PYTHON -m experiments.device_summary --out_dir=$OUT"
  echo "planned: $PLANNED s in all ($((PLANNED / 60)) min $((PLANNED % 60)) s)"
  exit 0
fi
# shellcheck disable=SC2046  # --dry or nothing
timeout 5 "$PYTHON" -m experiments.device_summary --out_dir="$OUT" $(dry && echo --dry) > "$OUT/summary.txt" 2>&1 \
  || echo "device_summary exit $?" >> "$OUT/summary.txt"
cd "$OUT" || exit 1
# Everything the blocks wrote at the top of $OUT, in one file (the device machine returns 8).
mapfile -t LOOSE < <(find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.log' -o -name '*.txt' -o -name '*.csv' \
  -o -name '*.png' \) ! -name summary.txt ! -name summary.json ! -name impl_table.json -printf '%P\n' | sort)
((${#LOOSE[@]})) && tar czf device_check.tgz "${LOOSE[@]}"
[[ $PACK != 0 ]] && ((${#LOOSE[@]})) && rm -f "${LOOSE[@]}"
echo "device_check:${FAILED:- every block ok}${FAILED:+ failed}; results in $OUT"
cat summary.txt
[[ -z $FAILED ]]
