#!/usr/bin/env bash
# Held-out perplexity of `--method lemo` against `--method lora` on the same data, steps and seed,
# every adapter evaluated densely on a book it did not see. One JSON line per case on stdout: the
# case, its extra train arguments, the final train loss, the mean kept fractions over the steps
# and the held-out perplexity.
#
# Default: stories260K (llama2.c, trained at 512 tokens) extended to 2048 tokens on one shared
# book (pg345), scored on another (pg11):
#   DATA=folder with stories260K.bin, tok512.bin, pg345.txt, pg11.txt  bench/lemo_accuracy.sh
# SmolLM2-135M (GGUF, trained at 8192) extended to 16384 with linear interpolation x2:
#   MODEL=SmolLM2-135M-Instruct.Q4_1.gguf TRAIN=books/ HELD_OUT=pg98.txt SEQ=16384 STEPS=100 \
#   LR=5e-4 WARMUP=5 PRECISION=bf16 bench/lemo_accuracy.sh
#
# env: LEMO (default target/release/lemo-train), DEVICE (cuda), RUNS (runs/lemo-accuracy) and
#      CASES="name|extra train arguments;..." (default: lora, and lemo at keep 0.5).
set -euo pipefail
LEMO=${LEMO:-target/release/lemo-train}
DATA=${DATA:-../shared/data}
MODEL=${MODEL:-$DATA/stories260K.bin}
TRAIN=${TRAIN:-$DATA/pg345.txt}
HELD_OUT=${HELD_OUT:-$DATA/pg11.txt}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-120}
LR=${LR:-2e-3}
WARMUP=${WARMUP:-10}
PRECISION=${PRECISION:-f32}
DEVICE=${DEVICE:-cuda}
RUNS=${RUNS:-runs/lemo-accuracy}
CASES=${CASES:-"lora|--method lora;lemo|--method lemo --target-keep 0.5"}
mkdir -p "$RUNS"

summary='
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if r.get("kind") == "train"]
mean = lambda key: (lambda v: sum(v) / len(v) if v else None)([r[key] for r in train if r.get(key) is not None])
print(json.dumps({"case": sys.argv[2], "train_args": sys.argv[3], "final_train_loss": train[-1]["loss"],
                  "keep_attention": mean("keep_attention"), "keep_mlp": mean("keep_mlp"),
                  "held_out_ppl": json.loads(sys.argv[4])["ppl"]}))'

IFS=';' read -r -a cases <<<"$CASES"
for case in "${cases[@]}"; do
  name=${case%%|*}
  extra=${case#*|}
  run=$RUNS/$name
  rm -rf "$run"
  # shellcheck disable=SC2086 # the case's extra arguments are meant to split
  if ! "$LEMO" train --model "$MODEL" --data "$TRAIN" --seq-len "$SEQ" --target-context "$SEQ" \
    --steps "$STEPS" --lr "$LR" --warmup-steps "$WARMUP" --device "$DEVICE" \
    --precision "$PRECISION" --val-every 0 $extra --out "$run" >"$run.train.log" 2>&1; then
    echo "{\"case\": \"$name\", \"error\": \"train failed: $(tail -n 1 "$run.train.log")\"}"
    continue
  fi
  eval_json=$("$LEMO" eval --model "$MODEL" --data "$HELD_OUT" --seq-len "$SEQ" --stride "$SEQ" \
    --adapter "$run/adapter" --device "$DEVICE" --precision "$PRECISION" --json \
    2>"$run.eval.log" | tail -n 1)
  python3 -c "$summary" "$run/metrics.jsonl" "$name" "$extra" "$eval_json"
done
