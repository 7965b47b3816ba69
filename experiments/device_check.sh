#!/usr/bin/env bash
# GPU checks for the device machine, run from anywhere:  OUT=/some/dir bash experiments/device_check.sh
# Each block writes its results under $OUT and must not stop the blocks after it
# (no `set -e`); each block states its own time budget.
set -u
OUT=${OUT:-/tmp/device_check}
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
echo "== bench_kl --preset=gpu"
timeout 235 python -m experiments.bench_kl --preset=gpu --time_budget_s=190 \
  --out="$OUT/bench_kl.json" > "$OUT/bench_kl.log" 2>&1
echo "bench_kl exit $?" >> "$OUT/bench_kl.log"
tail -n 45 "$OUT/bench_kl.log"
# ===== END losses ====================================================================
