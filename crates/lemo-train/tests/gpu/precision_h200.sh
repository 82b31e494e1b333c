#!/usr/bin/env bash
# bf16 and f32 on CUDA against the CPU, on the transformers fixtures (run from the repo root on
# the GPU machine, binary at .device/lemo-train unless LEMO says otherwise):
#  1. `eval --device cuda --precision bf16|f32` on every fixture vs `eval --device cpu` (f32):
#     bf16 within 1e-2 relative, f32 within 1e-3;
#  2. two `train` steps (lora, and longlora: f32 trainable embeddings and norms cast to bf16) on
#     one fixture: the logged losses of both steps on CUDA vs the same run on the CPU (the second
#     step's loss checks the first update, so the gradients), same tolerances; the bf16 adapter
#     (saved in f32) evaluated on the CPU vs the CPU run's adapter, same tolerances.
# Prints one JSON line per case; the exit status is the number of failed cases (capped at 1).
#   crates/lemo-train/tests/gpu/precision_h200.sh [OUT_DIR]
set -uo pipefail
bin=${LEMO:-.device/lemo-train}
fixtures=crates/lemo-models/tests/fixtures/hf
out=${1:-$(mktemp -d)}
mkdir -p "$out"

eval_loss() { # model data device precision [extra args...]
  local model=$1 data=$2 device=$3 precision=$4
  shift 4
  "$bin" eval --model "$model" --data "$data" --seq-len 64 --json --device "$device" \
    --precision "$precision" "$@" 2>>"$out/stderr.log" |
    python3 -c "import json,sys; print(json.load(sys.stdin)['loss'])" 2>/dev/null
}

failures=0
# case kind precision tolerance reference ours [detail]
report() {
  local line
  line=$(python3 - "$@" <<'PY'
import json, math, sys
case, kind, precision, tolerance, reference, ours = sys.argv[1:7]
detail = sys.argv[7] if len(sys.argv) > 7 else None
def number(v):
    try:
        return float(v)
    except ValueError:
        return None
r, o, t = number(reference), number(ours), float(tolerance)
relative = abs(o - r) / abs(r) if r is not None and o is not None and r != 0 else None
ok = relative is not None and math.isfinite(relative) and relative <= t
row = {"case": case, "kind": kind, "precision": precision, "reference_cpu_f32": r, "cuda": o,
       "relative_error": relative, "tolerance": t, "ok": ok}
if detail:
    row["detail"] = detail
print(json.dumps(row))
PY
  )
  echo "$line"
  echo "$line" >>"$out/precision.jsonl"
  [[ $line == *'"ok": true'* ]] || failures=$((failures + 1))
}

: >"$out/precision.jsonl"
for case_dir in "$fixtures"/*/; do
  case=$(basename "$case_dir")
  data=$case_dir/tokens.jsonl
  reference=$(eval_loss "$case_dir" "$data" cpu f32)
  for precision in bf16 f32; do
    tolerance=$([ "$precision" = bf16 ] && echo 1e-2 || echo 1e-3)
    ours=$(eval_loss "$case_dir" "$data" cuda "$precision")
    report "$case" eval "$precision" "$tolerance" "${reference:-nan}" "${ours:-nan}"
  done
done

# Training: the first two logged losses of a short run, and its adapter evaluated on the CPU.
train_case=llama_gqa_tied
train_dir=$fixtures/$train_case
train_run() { # run_dir method device precision
  "$bin" train --model "$train_dir" --data "$train_dir/tokens.jsonl" --method "$2" \
    --seq-len 32 --steps 2 --warmup-steps 0 --lr 1e-2 --val-every 0 --checkpoint-every 0 \
    --cache-dir none --device "$3" --precision "$4" --out "$1" >/dev/null 2>>"$out/stderr.log"
}
step_loss() { # run_dir step
  python3 -c "
import json, sys
for line in open(sys.argv[1] + '/metrics.jsonl'):
    row = json.loads(line)
    if row['kind'] == 'train' and row['step'] == int(sys.argv[2]):
        print(row['loss'])" "$1" "$2" 2>/dev/null
}
for method in lora longlora; do
  cpu_run=$out/train-$method-cpu
  rm -rf "$cpu_run"
  train_run "$cpu_run" "$method" cpu f32
  cpu_adapter=$(eval_loss "$train_dir" "$train_dir/tokens.jsonl" cpu f32 --adapter "$cpu_run/adapter")
  for precision in bf16 f32; do
    tolerance=$([ "$precision" = bf16 ] && echo 1e-2 || echo 1e-3)
    run=$out/train-$method-cuda-$precision
    rm -rf "$run"
    train_run "$run" "$method" cuda "$precision"
    for step in 1 2; do
      report "$train_case" "train-$method-step-$step" "$precision" "$tolerance" \
        "$(step_loss "$cpu_run" $step)" "$(step_loss "$run" $step)"
    done
    ours=$(eval_loss "$train_dir" "$train_dir/tokens.jsonl" cpu f32 --adapter "$run/adapter")
    report "$train_case" "train-$method-adapter" "$precision" "$tolerance" "${cpu_adapter:-nan}" \
      "${ours:-nan}" "adapter trained on cuda, evaluated on the cpu in f32"
  done
done

echo "$failures failed (stderr of the runs: $out/stderr.log)"
exit $((failures > 0))
