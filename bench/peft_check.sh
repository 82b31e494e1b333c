#!/usr/bin/env bash
# Does Hugging Face PEFT load a lemo-trained adapter and give the same loss as `lemo-train eval`?
# Trains the tiny preset (or uses RUN if it exists), scores a few of its stories with
# `lemo-train eval --adapter` and with PEFT (bench/reference/peft_load_check.py), and fails when
# the two losses differ by more than 1e-3. Needs python with torch, transformers and peft.
#
#   bench/peft_check.sh [RUN_DIR]        (env: LEMO=path/to/lemo-train PYTHON=python3 DEVICE=cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cpu}
RUN=${1:-runs/peft-check}
if [ ! -f "$RUN/adapter/adapter_config.json" ]; then
  "$LEMO" train --preset tiny --out "$RUN" --device "$DEVICE"
fi
IDS="$RUN/peft-check-ids.jsonl"
: > "$IDS"
head -n 4 "$RUN/data/stories.jsonl" | while IFS= read -r line; do
  text=$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["text"], end="")' "$line")
  echo "{\"input_ids\": $("$LEMO" tokenize --tokenizer "$RUN/base-model/tokenizer.json" --text "$text" --json)}" >> "$IDS"
done
ours=$("$LEMO" eval --model "$RUN/base-model" --adapter "$RUN/adapter" --data "$IDS" --seq-len 256 --device "$DEVICE" --json)
echo "lemo-train eval: $ours"
loss=$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["loss"])' "$ours")
"$PYTHON" bench/reference/peft_load_check.py --model "$RUN/base-model" --adapter "$RUN/adapter" \
  --data "$IDS" --seq-len 256 --expect-loss "$loss" --tolerance 1e-3 --merge
