#!/usr/bin/env bash
# Permutation-free token movement vs the naive path on the lent H200: PyTorch's eager naive path,
# then lemo's fused and naive paths (parity first), merged into one report. Build the harness on
# the CPU machine first and carry it with the device call:
#   cargo build --release -p lemo-kernel-bench --bin token_movement_bench
# then, on the GPU machine, from the repository root:
#   LEMO_COMMIT=<commit> bash kernels/run_token_movement_h200.sh [path/to/token_movement_bench]
# Writes kernels/results/h200_token_movement.json (and PyTorch's raw report beside it).
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH="${1:-target/release/token_movement_bench}"
SEQS="${SEQS:-4096,8192,16384,32768,65536}"
RESULTS=kernels/results
mkdir -p "$RESULTS"
COMMIT="${LEMO_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo uncommitted)}"
COMMAND="SEQS=$SEQS bash kernels/run_token_movement_h200.sh $*"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
PYTHONUNBUFFERED=1 python3 kernels/reference/token_movement_torch.py --seqs "$SEQS" \
    --out "$RESULTS/h200_token_movement_torch.json"
"$BENCH" --seqs "$SEQS" --torch "$RESULTS/h200_token_movement_torch.json" --commit "$COMMIT" \
    --command "$COMMAND" --out "$RESULTS/h200_token_movement.json"
if [ -n "${OUT:-}" ]; then cp "$RESULTS"/h200_token_movement*.json "$OUT"/; fi
