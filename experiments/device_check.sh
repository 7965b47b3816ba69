#!/usr/bin/env bash
# GPU checks for the device machine, run from anywhere:  OUT=/some/dir bash experiments/device_check.sh
# Each block writes its results under $OUT and must not stop the blocks after it
# (no `set -e`); each block states its own time budget.
# BLOCKS picks blocks (default: all), e.g. BLOCKS="spec" bash experiments/device_check.sh.
set -u
OUT=${OUT:-/tmp/device_check}
BLOCKS=${BLOCKS:-"losses rollout spec"}
want() { [[ " $BLOCKS " == *" $1 "* ]]; }
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
python -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())" \
  > "$OUT/versions.txt" 2>&1

# ===== BEGIN losses: fused linear top-K KL / log-prob (experiments/bench_kl.py) ======
# Budget: under 4 minutes. A cross-implementation agreement check (dense vs
# chunked_xla vs pallas on the GPU, N=2048), then fwd+bwd time and peak memory per
# implementation at N in {8k, 32k, 64k, 256k}, D=3072, V=128256, K=100, one fresh
# process per case; cases still queued after 190 s are recorded as skipped, and
# bench_kl.json is rewritten after every case, so an outer kill keeps what finished.
if want losses; then
echo "== bench_kl --preset=gpu"
timeout 215 python -m experiments.bench_kl --preset=gpu --time_budget_s=170 \
  --out="$OUT/bench_kl.json" > "$OUT/bench_kl.log" 2>&1
echo "bench_kl exit $?" >> "$OUT/bench_kl.log"
tail -n 45 "$OUT/bench_kl.log"
fi
# ===== END losses ====================================================================

# ===== BEGIN rollout: decode throughput vs HBM roofline and transformers (bench_rollout.py) =====
# Budget: under 3 minutes. Qwen2.5-0.5B and 1.5B shapes (random bf16 weights), batch
# 1..256, 64-token prompts, 128 decode steps in one device loop; transformers' generate
# (dynamic and static cache) on the same checkpoint at batch 16 and 64.
if want rollout; then
echo "== bench_rollout --preset=gpu"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 170 python -m experiments.bench_rollout --preset=gpu --hf_batches=16,64 \
  --out="$OUT/bench_rollout.json" > "$OUT/bench_rollout.log" 2>&1
echo "bench_rollout exit $?" >> "$OUT/bench_rollout.log"
tail -n 16 "$OUT/bench_rollout.log"
fi
# ===== END rollout ==============================================================================

# ===== BEGIN spec: speculative vs plain rollouts (train_drafter.py, bench_spec.py) ======
# Budget: under 4 minutes, run alone (BLOCKS=spec) when the others leave no room. Trains
# the tiny target's drafter on the GPU (its config's step count), then plain vs each
# strategy at batch 1..64, temperature 0 and 1, on held-out task prompts.
if want spec; then
echo "== train_drafter tiny + bench_spec --preset=gpu"
timeout 90 python -m experiments.train_drafter --config=configs/drafter.py:tiny \
  --config.run_dir="$OUT/drafter_tiny" > "$OUT/train_drafter.log" 2>&1
echo "train_drafter exit $?" >> "$OUT/train_drafter.log"
timeout 150 python -m experiments.bench_spec --preset=gpu --drafter="$OUT/drafter_tiny/drafter" \
  --out="$OUT/bench_spec.json" > "$OUT/bench_spec.log" 2>&1
echo "bench_spec exit $?" >> "$OUT/bench_spec.log"
tail -n 45 "$OUT/bench_spec.log"
rm -rf "$OUT/drafter_tiny/checkpoints"
fi
# ===== END spec ===========================================================================
