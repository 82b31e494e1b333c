#!/usr/bin/env bash
# Held-out perplexity of `--method lemo` with the attention and the MLP blocks calibrated to
# different kept fractions: for each split "A/M" of SPLITS, `calibrate` writes thresholds that
# keep A and M in both kinds of block, the attention thresholds of the first and the MLP ones of the second
# are merged into one file, and bench/lemo_accuracy.sh trains and evaluates with it. Same
# environment as bench/lemo_accuracy.sh (MODEL, TRAIN, HELD_OUT, SEQ, STEPS, LR, WARMUP,
# PRECISION, DEVICE, RUNS, LEMO), plus SPLITS (default "0.3/0.7 0.4/0.6").
set -euo pipefail
LEMO=${LEMO:-target/release/lemo-train}
DATA=${DATA:-../shared/data}
MODEL=${MODEL:-$DATA/stories260K.bin}
TRAIN=${TRAIN:-$DATA/pg345.txt}
SEQ=${SEQ:-2048}
PRECISION=${PRECISION:-f32}
DEVICE=${DEVICE:-cuda}
RUNS=${RUNS:-runs/lemo-keep-split}
SPLITS=${SPLITS:-"0.3/0.7 0.4/0.6"}
mkdir -p "$RUNS"
export LEMO DATA MODEL TRAIN SEQ PRECISION DEVICE RUNS

calibrated() { # keep -> thresholds file
  local file=$RUNS/thresholds-$1.json
  if [ ! -f "$file" ]; then
    "$LEMO" calibrate --model "$MODEL" --data "$TRAIN" --seq-len "$SEQ" --target-context "$SEQ" \
      --attention-keep "$1" --mlp-keep "$1" --device "$DEVICE" --precision "$PRECISION" --out "$file" \
      >"$file.log" 2>&1 || { tail -n 1 "$file.log" >&2; exit 1; }
  fi
  echo "$file"
}

cases=()
for split in $SPLITS; do
  attention=${split%/*}
  mlp=${split#*/}
  merged=$RUNS/thresholds-attention-$attention-mlp-$mlp.json
  python3 - "$(calibrated "$attention")" "$(calibrated "$mlp")" "$merged" <<'PY'
import json, sys
attention, mlp = (json.load(open(p)) for p in sys.argv[1:3])
for a, m in zip(attention["layers"], mlp["layers"]):
    a["mlp"] = m["mlp"]
attention["target_keep"] = None
attention["measured"] = None
json.dump(attention, open(sys.argv[3], "w"), indent=1)
PY
  cases+=("attention-$attention-mlp-$mlp|--method lemo --thresholds $merged")
done
CASES=$(IFS=';'; echo "${cases[*]}") bash "$(dirname "$0")/lemo_accuracy.sh"
