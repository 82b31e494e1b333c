#!/usr/bin/env bash
# Do transformers load what `lemo-train merge` writes, with the loss of `eval --adapter` on the
# base? Two cases, on the CPU:
#   stories260K (llama2.c, trained at 512 tokens): an adapter trained at 1024 tokens (RoPE linear
#     x2) on the start of one book, scored on another at 1024 tokens; merged with --gguf q8_0;
#   the Llama fixture (Hugging Face folder, GQA, tied embeddings): a LongLoRA adapter (embeddings
#     and norms trained too, RoPE x2); merged with --gguf f16.
# Each merged folder (and its GGUF, through transformers' GGUF reader) is scored by
# bench/reference/merged_load_check.py on the same token ids. Writes $RESULT (JSON).
# Needs python with torch, transformers and gguf.
#
#   bench/merge_check.sh   (env: LEMO=target/release/lemo-train PYTHON=python3 SHARED=../shared/data
#                           OUT=runs/merge-check RESULT=bench/results/cpu-merge-check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
SHARED=${SHARED:-../shared/data}
OUT=${OUT:-runs/merge-check}
RESULT=${RESULT:-bench/results/cpu-merge-check.json}
rm -rf "$OUT"
mkdir -p "$OUT"
CHECK="$PYTHON bench/reference/merged_load_check.py"

# Prints `eval --adapter`'s loss, then checks the merged folder against it; appends to $OUT/cases.
check_case() { # name base adapter merged gguf ids seq_len tolerance gguf_tolerance
  local expected
  expected=$("$LEMO" eval --model "$2" --adapter "$3" --data "$6" --seq-len "$7" --stride "$7" \
    --device cpu --json)
  local lemo_merged
  lemo_merged=$("$LEMO" eval --model "$4" --data "$6" --seq-len "$7" --stride "$7" --device cpu --json)
  local loss
  loss=$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["loss"])' "$expected")
  local report
  report=$($CHECK --model "$4" --gguf "$5" --data "$6" --seq-len "$7" --stride "$7" \
    --expect-loss "$loss" --tolerance "$8" --gguf-tolerance "$9")
  echo "$1: eval --adapter $expected; lemo eval merged $lemo_merged; transformers $report" >&2
  "$PYTHON" -c 'import json,sys; print(json.dumps({"case": sys.argv[1], "eval_adapter": json.loads(sys.argv[2]), "eval_merged": json.loads(sys.argv[3]), "transformers": json.loads(sys.argv[4])}))' \
    "$1" "$expected" "$lemo_merged" "$report" >> "$OUT/cases.jsonl"
}

# stories260K
S=$SHARED/models/stories260K
head -c 200000 "$SHARED/corpora/gutenberg/pg345.txt" > "$OUT/train.txt"
head -c 40000 "$SHARED/corpora/gutenberg/pg11.txt" > "$OUT/eval.txt"
echo "{\"input_ids\": $("$LEMO" tokenize --tokenizer "$S/tok512.bin" --file "$OUT/eval.txt" --json)}" \
  > "$OUT/s260k-ids.jsonl"
"$LEMO" train --model "$S/stories260K.bin" --data "$OUT/train.txt" --seq-len 1024 \
  --target-context 1024 --steps 60 --lr 2e-3 --warmup-steps 5 --val-every 0 --cache-dir none \
  --device cpu --out "$OUT/s260k" > /dev/null
"$LEMO" merge --model "$S/stories260K.bin" --adapter "$OUT/s260k/adapter" \
  --out "$OUT/s260k-merged" --gguf q8_0 > /dev/null
check_case stories260K "$S/stories260K.bin" "$OUT/s260k/adapter" "$OUT/s260k-merged" \
  "$OUT/s260k-merged/model-q8_0.gguf" "$OUT/s260k-ids.jsonl" 1024 1e-5 1e-2

# The Llama fixture, LongLoRA
F=crates/lemo-models/tests/fixtures/hf/llama_gqa_tied
"$LEMO" train --model "$F" --data "$F/tokens.jsonl" --method longlora --target-context 256 \
  --seq-len 32 --steps 10 --lr 1e-2 --warmup-steps 0 --val-every 0 --checkpoint-every 0 \
  --cache-dir none --device cpu --out "$OUT/fixture" > /dev/null
"$LEMO" merge --model "$F" --adapter "$OUT/fixture/adapter" --out "$OUT/fixture-merged" \
  --gguf f16 > /dev/null
check_case llama_gqa_tied-longlora "$F" "$OUT/fixture/adapter" "$OUT/fixture-merged" \
  "$OUT/fixture-merged/model-f16.gguf" "$F/tokens.jsonl" 64 1e-5 2e-3

"$PYTHON" - "$OUT/cases.jsonl" "$RESULT" "$(git rev-parse HEAD)" <<'EOF'
import json, platform, sys
cases = [json.loads(line) for line in open(sys.argv[1])]
result = {
    "check": "lemo-train merge output loaded by Hugging Face transformers (safetensors folder; GGUF "
             "through transformers' GGUF reader) gives the loss of lemo-train eval --adapter on the base",
    "device": f"CPU ({platform.machine()}), float32",
    "command": "bench/merge_check.sh",
    "commit": sys.argv[3],
    "cases": cases,
    "ok": all(c["transformers"].get("ok") for c in cases),
}
open(sys.argv[2], "w").write(json.dumps(result, indent=1) + "\n")
print(json.dumps({c["case"]: c["transformers"]["ok"] for c in cases}))
EOF
