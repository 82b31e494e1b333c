#!/usr/bin/env bash
# GEMM, fused-kernel and segment-loss parity and throughput on the lent H200, ours vs PyTorch
# in the same run. Build the harness on the CPU machine first and carry it with the device call:
#   cargo build --release -p lemo-kernel-bench --bin compute_bench   # -> target/release/compute_bench
# then, on the GPU machine, from the repository root:
#   bash kernels/run_compute_h200.sh [path/to/compute_bench] [--quick]
# Merges into kernels/results/h200.json and writes the two raw reports beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH="${1:-target/release/compute_bench}"
QUICK="${2:-}"
RESULTS=kernels/results
mkdir -p "$RESULTS"
COMMIT="${LEMO_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo uncommitted)}"
COMMAND="bash kernels/run_compute_h200.sh $*"
# cuBLASLt is loaded at run time: use the toolkit's or PyTorch's copy.
TORCH_LIBS="$(python3 -c 'import glob, os, site
hits = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, "nvidia", "**", "libcublasLt.so*"), recursive=True)]
print(os.path.dirname(hits[0]) if hits else "")' 2>/dev/null || true)"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64:${TORCH_LIBS}"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
python3 kernels/reference/compute_torch.py $QUICK --out "$RESULTS/h200_compute_torch.json"
"$BENCH" $QUICK --out "$RESULTS/h200_compute_lemo.json"
python3 kernels/merge_compute.py --ours "$RESULTS/h200_compute_lemo.json" \
    --reference "$RESULTS/h200_compute_torch.json" --commit "$COMMIT" --command "$COMMAND" \
    --out "$RESULTS/h200.json"
if [ -n "${OUT:-}" ]; then cp "$RESULTS"/h200.json "$RESULTS"/h200_compute_*.json "$OUT"/; fi
