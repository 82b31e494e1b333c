#!/usr/bin/env bash
# Where a training step's GPU time goes outside the GEMMs and attention: runs `lemo-train bench`
# with CubeCL's profiling logger on (every CubeCL kernel timed; the run is slower than an
# unprofiled one) and summarizes the last step with bench/profile_summary.py. Run the same case
# without profiling beside it for the step time: that minus the CubeCL total is cuBLASLt,
# cuDNN and launch gaps.
#
#   bench/profile_step.sh --method lora --seq-lens 8192
#   bench/profile_step.sh --method lemo --scores predicted --target-keep 0.5 --seq-lens 8192
#
# env: LEMO (binary, default target/release/lemo-train), CONFIG (default llama-2-7b), OUT (folder
#      for the log and the JSON summary; default a temporary one).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LEMO=$(realpath "${LEMO:-$ROOT/target/release/lemo-train}")
CONFIG=${CONFIG:-llama-2-7b}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
WORK=$(mktemp -d)
# CubeCL reads cubecl.toml from the working directory.
printf '[profiling.logger]\nlevel = "basic"\nfile = "%s/profile.log"\n' "$OUT" > "$WORK/cubecl.toml"
rm -f "$OUT/profile.log"
(cd "$WORK" && "$LEMO" bench --model "$ROOT/bench/configs/$CONFIG.json" --steps 2 --warmup 1 \
  --device cuda --out "$OUT/bench.json" "$@" > /dev/null)
python3 "$ROOT/bench/profile_summary.py" "$OUT/profile.log" --json "$OUT/profile.json"
echo "log and summary in $OUT"
