#!/usr/bin/env bash
# GPU checks for the device machine, run from anywhere:  OUT=/some/dir bash experiments/device_check.sh
# Each block writes its results under $OUT and must not stop the blocks after it
# (no `set -e`); each block's commands carry their own timeouts, which sum to under
# 8 minutes for the default BLOCKS (verify 0.7 + spec 4.3 + tlt 3; rollout, losses and
# attention on request).
# Blocks run in the order of what is least measured.
# BLOCKS picks blocks, e.g. BLOCKS="losses" bash experiments/device_check.sh.
set -u
OUT=${OUT:-/tmp/device_check}
cd "$(dirname "$0")/.." || exit 1
# Without ml-collections (every config file needs it) and without a package index, the
# wheel comes along in .whl/: `python -m pip download --no-deps -d .whl ml-collections==1.1.0`.
if ! python -c "import ml_collections" 2>/dev/null; then
  python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || echo "no ml_collections wheel in .whl/"
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
BLOCKS=${BLOCKS:-"verify spec tlt"}
want() { [[ " $BLOCKS " == *" $1 "* ]]; }
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
python -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())" \
  > "$OUT/versions.txt" 2>&1

# ===== BEGIN verify: draft-tree verification, jnp reference vs V-tiled Pallas kernel (bench_verify.py) =====
# Budget: 40 seconds. Qwen2.5's V = 151936, sampled drafts, T = 48, 16, 8 nodes at batch
# 1 and 8, until the budget stops new cases (the deterministic mode and more block sizes:
# BLOCKS=verify VERIFY_ARGS="--modes=deterministic --block_v=4096"). Each row says
# whether the kernel's outputs equal the reference's; spec_verify's impl="auto" moves to
# the kernel only where it is faster here.
if want verify; then
echo "== bench_verify (V=151936)"
timeout 40 python -m experiments.bench_verify --nodes=48,16,8 --batches=1,8 --repeats=5 --time_budget_s=25 \
  ${VERIFY_ARGS:---modes=sampled} --out="$OUT/bench_verify.json" > "$OUT/bench_verify.log" 2>&1
echo "bench_verify exit $?" >> "$OUT/bench_verify.log"
tail -n 10 "$OUT/bench_verify.log"
fi
# ===== END verify =================================================================================

# ===== BEGIN spec: speculative vs plain rollouts (sft.py, train_drafter.py, bench_spec.py) =====
# Budget: 4.3 minutes. Trains the 180M-parameter target of configs/sft.py:gpu on the
# addition traces (float32 masters, bfloat16 compute), then its one-layer drafter, then
# plain vs a 6-deep EAGLE chain at temperature 1 (the bars), bfloat16, batch 1, then 8,
# 4, 16, 32, 64 as long as the budget lets a new batch size start. Each batch size
# compiles its own steps (tens of seconds for 16 unrolled layers), so expect batch 1
# and 8; the other strategies and temperature 0 are for a run of their own:
#   BLOCKS=spec SPEC_ARGS="--strategies=eagle-d4,eagle-d5-k3-t12,ngram-d4-b2 --temperatures=0,1"
if want spec; then
echo "== sft gpu + train_drafter gpu + bench_spec --preset=gpu"
timeout 110 python -m experiments.sft --config=configs/sft.py:gpu --config.run_dir="$OUT/sft_gpu" \
  --config.data.num_eval=64 > "$OUT/sft.log" 2>&1
echo "sft exit $?" >> "$OUT/sft.log"
timeout 70 python -m experiments.train_drafter --config=configs/drafter.py:gpu --config.acceptance.num_prompts=16 \
  --config.target_dir="$OUT/sft_gpu/hf" --config.run_dir="$OUT/drafter_gpu" > "$OUT/train_drafter.log" 2>&1
echo "train_drafter exit $?" >> "$OUT/train_drafter.log"
timeout 75 python -m experiments.bench_spec --preset=gpu --target="$OUT/sft_gpu/hf" \
  --drafter="$OUT/drafter_gpu/drafter" --dtype=bfloat16 --batches=1,8,4,16,32,64 --time_budget_s=30 \
  ${SPEC_ARGS:---strategies=eagle-d6 --temperatures=1} --out="$OUT/bench_spec.json" > "$OUT/bench_spec.log" 2>&1
echo "bench_spec exit $?" >> "$OUT/bench_spec.log"
tail -n 3 "$OUT/sft.log" "$OUT/train_drafter.log"
tail -n 20 "$OUT/bench_spec.log"
rm -rf "$OUT/sft_gpu/checkpoints" "$OUT/drafter_gpu/checkpoints"  # the tlt block reuses hf/ and drafter/
fi
# ===== END spec ===================================================================================

# ===== BEGIN tlt: TLT against the baseline end to end (bench_tlt.py) ==========================
# Budget: 3 minutes. The spec block's 180M target and drafter (run it first): the same RL
# run with TLT off and on, back to back; bars: step_speedup >= 2.0 (TLT: 1.7-2.1x vs verl),
# acceptance >= 4 at temperature 1, eval accuracy within seed noise.
if want tlt; then
echo "== bench_tlt --preset=gpu"
timeout 180 python -m experiments.bench_tlt --preset=gpu --target="$OUT/sft_gpu/hf" \
  --drafter="$OUT/drafter_gpu/drafter" --run_dir="$OUT/bench_tlt_runs" --cache_dir="$OUT/bench_tlt_cache" \
  --out="$OUT/bench_tlt.json" > "$OUT/bench_tlt.log" 2>&1
echo "bench_tlt exit $?" >> "$OUT/bench_tlt.log"
tail -n 8 "$OUT/bench_tlt.log"
rm -rf "$OUT/bench_tlt_runs" "$OUT/bench_tlt_cache"
fi
rm -rf "$OUT/sft_gpu" "$OUT/drafter_gpu"
# ===== END tlt ================================================================================

# ===== BEGIN rollout: decode throughput vs HBM roofline and transformers (bench_rollout.py) =====
# Budget: about 2 minutes. Qwen2.5-1.5B shape (random bf16 weights), batch 16 and 1, the
# default decode layout (fused, per layer) against the first H200 run's (stacked, scanned);
# transformers' generate (dynamic and static cache) at batch 16.
if want rollout; then
echo "== bench_rollout --preset=gpu"
# The engine's optimized GPU HLO (insert and decode-chunk modules) comes back as
# rollout_hlo.tgz: which kernels a decode step launches, and any weight or cache copies.
XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/rollout_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_fn" \
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 130 python -m experiments.bench_rollout --preset=gpu \
  --models=qwen2.5-1.5b --batches=16,1 --layouts=fused,stacked --hf_batches=16 \
  --out="$OUT/bench_rollout.json" > "$OUT/bench_rollout.log" 2>&1
echo "bench_rollout exit $?" >> "$OUT/bench_rollout.log"
(cd "$OUT" && find rollout_hlo -name '*after_optimizations.txt' | tar czf rollout_hlo.tgz -T -)
rm -rf "$OUT/rollout_hlo"
tail -n 10 "$OUT/bench_rollout.log"
fi
# ===== END rollout ==============================================================================

# ===== BEGIN losses: fused linear top-K KL / log-prob (experiments/bench_kl.py) ======
# Budget: under 1.5 minutes: the dense anchor (for the ratios), then the cases the first run
# did not reach: bf16 dW accumulation at 32k and 256k tokens, the Pallas kernels (one
# fresh process per case; bench_kl.json is rewritten after every case, so an outer kill
# keeps what finished). `--only` dropped, the whole preset takes about 4 minutes.
if want losses; then
echo "== bench_kl --preset=gpu --only=..."
timeout 85 python -m experiments.bench_kl --preset=gpu --time_budget_s=55 \
  --only="chunked_xla[dw_accum=param],pallas,anchor_dense" --out="$OUT/bench_kl.json" > "$OUT/bench_kl.log" 2>&1
echo "bench_kl exit $?" >> "$OUT/bench_kl.log"
tail -n 25 "$OUT/bench_kl.log"
fi
# ===== END losses ====================================================================

# ===== BEGIN attention: attention memory and time at reasoning lengths (bench_attention.py) =====
# Budget: under 2 minutes. Qwen2.5-1.5B's shapes, bf16, batch 1: agreement of blockwise and
# cuDNN with dense at T=2048, then forward + backward of the attention core at 8k-32k
# tokens: XLA temp bytes (the CPU table's numbers, here from the GPU compiler) and
# time; dense is expected to run out of memory at 32k. Then packed segments (blockwise
# only: cuDNN's public API has no segment ids).
if want attention; then
echo "== bench_attention --time --check"
timeout 75 python -m experiments.bench_attention --scopes=attention --time --check \
  --out="$OUT/bench_attention.json" > "$OUT/bench_attention.log" 2>&1
echo "bench_attention exit $?" >> "$OUT/bench_attention.log"
timeout 40 python -m experiments.bench_attention --scopes=attention --time --segments --impls=blockwise \
  --out="$OUT/bench_attention_segments.json" > "$OUT/bench_attention_segments.log" 2>&1
echo "bench_attention segments exit $?" >> "$OUT/bench_attention_segments.log"
tail -n 16 "$OUT/bench_attention.log" "$OUT/bench_attention_segments.log"
fi
# ===== END attention ================================================================================
