#!/usr/bin/env bash
# Attention parity and throughput on the lent H200, ours vs PyTorch SDPA (flash, cuDNN, efficient
# and the default backend) in the same run.
# Build the harness on the CPU machine first and carry it with the device call:
#   cargo build --release -p lemo-kernel-bench        # -> target/release/attention_bench
# then, on the GPU machine, from the repository root:
#   bash kernels/run_h200.sh [path/to/attention_bench]
# Merges into kernels/results/h200.json (keeping the other kernels' entries) and leaves the raw
# reports beside it.
# Environment:
#   SEQS=4096,16384,65536    sequence lengths
#   KV_HEADS=32,8            key/value heads per timed shape (32 query heads): MHA and GQA 32/8
#   VARIANTS="cudnn tensor-core plain"   our kernel variants, one process each
#   VARIANT_TIMEOUT=240      seconds per variant process (the plain kernels at 64K take minutes)
#   COMMIT, PYTHON, OUT      commit stamped on the results, interpreter, folder to copy them to
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH="${1:-target/release/attention_bench}"
SEQS="${SEQS:-4096,16384,65536}"
KV_HEADS="${KV_HEADS:-32,8}"
VARIANTS="${VARIANTS:-cudnn tensor-core plain}"
PYTHON="${PYTHON:-python3}"
RESULTS=kernels/results
PARITY_DIR="$(mktemp -d)"
mkdir -p "$RESULTS"
# COMMIT may be given when the script runs from a copy outside the checkout it measures.
COMMIT="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo uncommitted)}"
COMMAND="SEQS=$SEQS KV_HEADS=$KV_HEADS VARIANTS=\"$VARIANTS\" bash kernels/run_h200.sh $*"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" kernels/reference/attention_sdpa.py --seqs "$SEQS" --kv-heads "$KV_HEADS" \
    --parity-dir "$PARITY_DIR" --out "$RESULTS/h200_sdpa.json"
# One process per kernel variant, so a failure of one keeps the other's results; a report left
# from an earlier run is removed first so that a failed variant is skipped rather than merged stale.
for variant in $VARIANTS; do
    rm -f "$RESULTS/h200_lemo_$variant.json"
    timeout "${VARIANT_TIMEOUT:-240}" "$BENCH" --seqs "$SEQS" --kv-heads "$KV_HEADS" \
        --parity-dir "$PARITY_DIR" --variants "$variant" --out "$RESULTS/h200_lemo_$variant.json" ||
        echo "attention_bench --variants $variant failed"
done
"$PYTHON" kernels/merge_attention.py \
    --ours $(for variant in $VARIANTS; do echo "$RESULTS/h200_lemo_$variant.json"; done) \
    --reference "$RESULTS/h200_sdpa.json" --commit "$COMMIT" --command "$COMMAND" \
    --out "$RESULTS/h200.json"
# The results folder comes back with the call when it is under $OUT.
if [ -n "${OUT:-}" ]; then cp "$RESULTS"/h200.json "$RESULTS"/h200_sdpa.json "$RESULTS"/h200_lemo_*.json "$OUT"/; fi
