#!/usr/bin/env bash
# Attention parity and throughput on the lent H200, ours vs PyTorch SDPA in the same run.
# Build the harness on the CPU machine first and carry it with the device call:
#   cargo build --release -p lemo-kernel-bench        # -> target/release/attention_bench
# then, on the GPU machine, from the repository root:
#   bash kernels/run_h200.sh [path/to/attention_bench]
# Merges into kernels/results/h200.json (keeping the other kernels' entries) and leaves the raw
# reports beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH="${1:-target/release/attention_bench}"
SEQS="${SEQS:-4096,16384,65536}"
PYTHON="${PYTHON:-python3}"
RESULTS=kernels/results
PARITY_DIR="$(mktemp -d)"
mkdir -p "$RESULTS"
# COMMIT may be given when the script runs from a copy outside the checkout it measures.
COMMIT="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo uncommitted)}"
COMMAND="bash kernels/run_h200.sh $*"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" kernels/reference/attention_sdpa.py --seqs "$SEQS" --parity-dir "$PARITY_DIR" \
    --out "$RESULTS/h200_sdpa.json"
# One process per kernel variant, so a failure of one keeps the other's results.
for variant in ${VARIANTS:-plain tensor-core}; do
    timeout 240 "$BENCH" --seqs "$SEQS" --parity-dir "$PARITY_DIR" --variants "$variant" \
        --out "$RESULTS/h200_lemo_$variant.json" || echo "attention_bench --variants $variant failed"
done
"$PYTHON" kernels/merge_attention.py \
    --ours $(for variant in ${VARIANTS:-plain tensor-core}; do echo "$RESULTS/h200_lemo_$variant.json"; done) \
    --reference "$RESULTS/h200_sdpa.json" --commit "$COMMIT" --command "$COMMAND" \
    --out "$RESULTS/h200.json"
# The results folder comes back with the call when it is under $OUT.
if [ -n "${OUT:-}" ]; then cp "$RESULTS"/h200.json "$RESULTS"/h200_sdpa.json "$RESULTS"/h200_lemo_*.json "$OUT"/; fi
