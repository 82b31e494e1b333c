#!/usr/bin/env bash
# Extends SmolLM2-135M (GGUF, trained context 8192) to 32768 tokens with LoRA and RoPE scaling
# by 4 (linear position interpolation, or YaRN with ROPE=yarn) on four shared books, then
# measures on a fifth book it did not see: perplexity at 8K, 16K and 32K (non-overlapping
# windows) and passkey retrieval at the same lengths, for the fine-tuned model, and for the base
# model without and with linear interpolation. Each measurement is one JSON line in $RESULTS,
# with the command that made it.
#
#   M=$(cargo xtask fetch-model smollm2-135m)
#   MODEL=$M BOOKS=../shared/data/corpora/gutenberg datasets/smollm2-extend-32k.sh
#   MODEL=$M BOOKS=../shared/data/corpora/gutenberg ROPE=yarn RUN=runs/smollm2-32k-yarn \
#     BASE=0 datasets/smollm2-extend-32k.sh      # the same data and steps with YaRN
#   MODEL=$M BOOKS=../shared/data/corpora/gutenberg ROPE=yarn QA=400 RUN=runs/smollm2-32k-qa \
#     LONGBENCH=../shared/data/eval/longbench-v2/longbench_v2_samples.jsonl BASE=0 \
#     datasets/smollm2-extend-32k.sh             # long-document instruction tuning as well
#
# With QA=N, N chat records of long-document question answering made from the training books
# (datasets/long_context_qa.py: passkeys and chapter questions deep in excerpts of up to 90% of
# TARGET) join the books, and the loss is on the books' tokens and the records' answers
# (--loss-on assistant); the models are then also scored on such records made from the held-out
# book (answer tokens' loss) and on passkey prompts in the chat template's user turn as well
# (eval --passkey --chat: the form the records train). LONGBENCH names LongBench-v2 JSONL to score as well (multiple
# choice, contexts cut to TARGET).
#
# env: LEMO (binary, default target/release/lemo-train), MODEL, BOOKS, RUN (run folder, default
#      runs/smollm2-32k), RESULTS (default $RUN/results.jsonl), STEPS (default 150), LR (default
#      5e-4), TRIALS (passkey prompts per length, default 10), DEVICE (default cuda), TARGET (the
#      context to extend to, default 32768), ROPE (--rope-scaling: linear, yarn, dynamic or
#      llama3; default linear), QA (long-document QA records, default 0), LONGBENCH, BASE (0:
#      skip the base model's measurements) and LENGTHS
#      (evaluated lengths, default "8192 16384 32768"): small values make a quick check of the
#      recipe on a CPU.
set -euo pipefail
LEMO=${LEMO:-target/release/lemo-train}
MODEL=${MODEL:?set MODEL to SmolLM2-135M-Instruct.Q4_1.gguf (cargo xtask fetch-model smollm2-135m)}
BOOKS=${BOOKS:?set BOOKS to the folder of Gutenberg books (../shared/data/corpora/gutenberg)}
RUN=${RUN:-runs/smollm2-32k}
RESULTS=${RESULTS:-$RUN/results.jsonl}
STEPS=${STEPS:-150}
LR=${LR:-5e-4}
TRIALS=${TRIALS:-10}
DEVICE=${DEVICE:-cuda}
TARGET=${TARGET:-32768}
ROPE=${ROPE:-linear}
BASE=${BASE:-1}
QA=${QA:-0}
LONGBENCH=${LONGBENCH:-}
read -r -a LENGTHS <<<"${LENGTHS:-8192 16384 32768}"
TRAIN_BOOKS=(pg2701 pg4300 pg1342 pg345) # Moby Dick, Ulysses, Pride and Prejudice, Dracula
HELD_OUT=pg98                            # A Tale of Two Cities

mkdir -p "$RUN/train-data" "$(dirname "$RESULTS")"
for book in "${TRAIN_BOOKS[@]}"; do cp "$BOOKS/$book.txt" "$RUN/train-data/"; done
qa_flags=()
if [ "$QA" != 0 ]; then
  qa() { python3 "$(dirname "$0")/long_context_qa.py" --books "$BOOKS" --min-tokens $((TARGET / 16)) --max-tokens $((TARGET * 9 / 10)) "$@"; }
  qa "${TRAIN_BOOKS[@]/#/--book=}" --records "$QA" --out "$RUN/train-data/qa.jsonl"
  qa --book="$HELD_OUT" --records 100 --seed 1 --out "$RUN/held-out-qa.jsonl"
  qa_flags=(--loss-on assistant)
fi

# Runs a command, prints its stdout's last line as `"result"` in one JSON line with a label.
record() {
  local label=$1
  shift
  echo "+ $*" >&2
  local started=$SECONDS output
  output=$("$@" | tail -n 1) || output="{\"error\": \"exit status $?\"}"
  printf '{"case": "%s", "command": "%s", "seconds": %d, "result": %s}\n' \
    "$label" "$*" $((SECONDS - started)) "$output" >>"$RESULTS"
}

evaluate() {
  local name=$1
  shift
  for length in "${LENGTHS[@]}"; do
    record "$name ppl $length" "$LEMO" eval --model "$MODEL" --data "$BOOKS/$HELD_OUT.txt" \
      --seq-len "$length" --stride "$length" --device "$DEVICE" --json "$@"
  done
  record "$name passkey" "$LEMO" eval --model "$MODEL" --passkey --json \
    --lengths "$(IFS=,; echo "${LENGTHS[*]}")" --trials "$TRIALS" --device "$DEVICE" "$@"
  if [ "$QA" != 0 ]; then
    record "$name passkey (chat)" "$LEMO" eval --model "$MODEL" --passkey --chat --json \
      --lengths "$(IFS=,; echo "${LENGTHS[*]}")" --trials "$TRIALS" --device "$DEVICE" "$@"
    record "$name held-out QA answers" "$LEMO" eval --model "$MODEL" --data "$RUN/held-out-qa.jsonl" \
      --loss-on assistant --seq-len "$TARGET" --device "$DEVICE" --json "$@"
  fi
  if [ -n "$LONGBENCH" ]; then
    record "$name LongBench-v2" "$LEMO" eval --model "$MODEL" --longbench --data "$LONGBENCH" \
      --max-tokens "$TARGET" --device "$DEVICE" --json "$@"
  fi
}

echo "+ train" >&2
started=$SECONDS
train=("$LEMO" train --model "$MODEL" --data "$RUN/train-data" --seq-len "$TARGET"
  --target-context "$TARGET" --rope-scaling "$ROPE" --steps "$STEPS" --lr "$LR" --warmup-steps 5 --val-every 0
  "${qa_flags[@]}" --device "$DEVICE" --out "$RUN/train")
"${train[@]}"
printf '{"case": "train", "command": "%s", "seconds": %d, "result": %s}\n' \
  "${train[*]}" $((SECONDS - started)) "$(tr -d '\n' <"$RUN/train/summary.json")" >>"$RESULTS"
# The fine-tuned model first: the measurement that matters most when time is short.
evaluate "fine-tuned ($ROPE)" --adapter "$RUN/train/adapter"
if [ "$BASE" != 0 ]; then
  evaluate base
  evaluate "base, interpolation to $TARGET" --target-context "$TARGET"
fi
echo "results: $RESULTS" >&2
