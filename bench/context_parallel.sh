#!/usr/bin/env bash
# Context parallelism on the GPUs of one machine:
#   1. equivalence: the llama_gqa_tied fixture (f32, 64 tokens, 3 steps) split over GPUS ranks
#      (--context-parallel GPUS) against one GPU: lora (every step's loss) and lemo (the first
#      step's loss: later steps keep balanced rows of their own);
#   2. scale: the CONFIG shape cut to LAYERS layers, random weights (bench/random_llama.py), bf16,
#      LoRA r=8, STEPS steps, one case per "method:ranks[:tokens]" of CASES (ranks > 1:
#      --gpus N --context-parallel N; tokens default SEQ), each stopped after LIMIT seconds;
#      per-GPU device peaks by nvidia-smi (20 ms), and per-GPU model FLOP/s against one GPU.
# Three files in OUT, appended to as each run finishes (a run cut short keeps what it measured):
# summary.txt, runs.log (every run's output) and metrics.jsonl (every run's metrics, each record
# with its run's name). Each run has its own time limit, so one that hangs cannot take the rest.
#
#   LEMO=path/to/lemo-train OUT=results-dir bench/context_parallel.sh
#
# env: LEMO (default target/release/lemo-train), OUT (default bench/results/context-parallel),
#      GPUS (default 2), CASES (default "lora:1 lora:2 lemo:1 lemo:2"; empty: equivalence only),
#      CONFIG (default bench/configs/llama-2-7b.json), SEQ (default 16384), LAYERS (default 8),
#      STEPS (default 4), LIMIT (default 90), WORK, PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
OUT=${OUT:-bench/results/context-parallel}
GPUS=${GPUS:-2}
CASES=${CASES-lora:1 lora:2 lemo:1 lemo:2}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
# shellcheck source=bench/nccl_env.sh
. bench/nccl_env.sh

fixture=crates/lemo-models/tests/fixtures/hf/llama_gqa_tied
# keep NAME: appends run NAME's log and metrics (from WORK) to OUT.
keep() {
  { echo "== $1"; cat "$WORK/$1.log"; } >> "$OUT/runs.log"
  [ -f "$WORK/$1/metrics.jsonl" ] && "$PYTHON" -c "
import json, sys
for line in open('$WORK/$1/metrics.jsonl'):
    print(json.dumps({'run': '$1', **json.loads(line)}))" >> "$OUT/metrics.jsonl"
}
tiny() {
  local name=$1
  shift
  timeout -k 2 60 "$LEMO" train --model $fixture --data $fixture/tokens.jsonl --seq-len 64 \
    --steps 3 --warmup-steps 0 --lr 1e-2 --val-every 0 --checkpoint-every 0 --cache-dir none \
    --device cuda --precision f32 --batch-size 1 --collective-timeout 30s --out "$WORK/$name" \
    "$@" > "$WORK/$name.log" 2>&1
  echo "$name: exit status $? ($*)" | tee -a "$OUT/summary.txt"
  keep "$name"
}
# Each rank's share of the 64 tokens is two chunks of whole blocks (the zig-zag split).
lemo="--method lemo --attention-keep 0.5 --block-size $((64 / (2 * GPUS)))"
tiny split --gpus "$GPUS" --context-parallel "$GPUS"
tiny whole --gpus 1
# shellcheck disable=SC2086
tiny split_lemo $lemo --gpus "$GPUS" --context-parallel "$GPUS"
# shellcheck disable=SC2086
tiny whole_lemo $lemo --gpus 1
"$PYTHON" - "$WORK" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
work = sys.argv[1]
def losses(name):
    path = os.path.join(work, name, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    return [r["loss"] for r in map(json.loads, open(path)) if r.get("kind") == "train"]
for a, b, first in [("split", "whole", False), ("split_lemo", "whole_lemo", True)]:
    x, y = losses(a), losses(b)
    if not x or not y or len(x) != len(y):
        print(f"{a} vs {b}: no comparison ({x} / {y})")
        continue
    if first:
        x, y = x[:1], y[:1]
    error = max(abs(p - q) / abs(q) for p, q in zip(x, y))
    print(f"{a} vs {b}: max relative loss difference {error:.2e} ({'ok' if error <= 1e-4 else 'FAIL'})")
PY

[ -z "$CASES" ] && exit 0
longest=$(for case in $CASES; do IFS=: read -r _ _ tokens <<< "$case"; echo "${tokens:-${SEQ:-16384}}"; done | sort -n | tail -1)
"$PYTHON" -c "
import json; c = json.load(open('${CONFIG:-bench/configs/llama-2-7b.json}'))
c['num_hidden_layers'] = ${LAYERS:-8}
c['max_position_embeddings'] = max(c.get('max_position_embeddings', 4096), $longest)
json.dump(c, open('$WORK/config.json', 'w'))"
"$PYTHON" bench/random_llama.py "$WORK/config.json" "$WORK/model" "$WORK/data.jsonl" || exit 1
for case in $CASES; do
  IFS=: read -r method ranks tokens <<< "$case"
  tokens=${tokens:-${SEQ:-16384}}
  name=$method-$ranks-$tokens
  flags=(--gpus 1)
  [ "$ranks" -gt 1 ] && flags=(--gpus "$ranks" --context-parallel "$ranks")
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 20 > "$WORK/poll.log" 2>/dev/null &
  poller=$!
  timeout -k 2 "${LIMIT:-90}" "$LEMO" train --model "$WORK/model" --data "$WORK/data.jsonl" \
    --method "$method" --seq-len "$tokens" --target-context "$tokens" \
    --steps "${STEPS:-4}" "${flags[@]}" --device cuda --precision bf16 --lora-rank 8 --lr 1e-4 \
    --warmup-steps 0 --val-fraction 0 --checkpoint-every 0 --save-every 0 --cache-dir none \
    --collective-timeout 60s --out "$WORK/$name" > "$WORK/$name.log" 2>&1
  status=$?
  kill "$poller"
  wait "$poller" 2>/dev/null
  peaks=$("$PYTHON" -c "
import collections
peak, first = collections.defaultdict(int), {}
for line in open('$WORK/poll.log'):
    try: gpu, used = (int(v) for v in line.split(','))
    except ValueError: continue
    first.setdefault(gpu, used); peak[gpu] = max(peak[gpu], used)
print(' '.join(f'gpu{g}={peak[g] - first[g]}MiB' for g in sorted(peak)))")
  echo "$case: exit status $status, device peaks above idle $peaks" | tee -a "$OUT/summary.txt"
  keep "$name"
done
# Per-GPU model FLOP/s of each case (steps after the first, median), against the one-GPU case of
# its method. Executed FLOPs of LoRA on a frozen base: the linear maps (and the LM head) 2N
# forward + 2N for the input gradients per token; causal attention 2 S^2 d forward per layer
# (QK^T and PV over the visible half) and 2.5x that backward (FlashAttention's count); a
# sequence split over R ranks does 1/R of each on every GPU.
"$PYTHON" - "$WORK/config.json" "$OUT/metrics.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import collections, json, statistics, sys
c = json.load(open(sys.argv[1]))
h, f, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
kv = c.get("num_key_value_heads", c["num_attention_heads"]) * h // c["num_attention_heads"]
linear = layers * (2 * h * h + 2 * h * kv + 3 * h * f) + vocab * h
runs = collections.defaultdict(list)
for line in open(sys.argv[2]):
    r = json.loads(line)
    if r.get("kind") == "train" and r["run"].count("-") == 2:
        runs[r["run"]].append(r)
rates = {}
for run, steps in runs.items():
    method, ranks, tokens = run.split("-")
    ranks, tokens = int(ranks), int(tokens)
    timed = [s["step_time_s"] for s in steps[1:]] or [steps[0]["step_time_s"]]
    step = statistics.median(timed)
    flops = 4 * linear * tokens + 7 * layers * h * tokens * tokens
    rates[run] = (method, ranks, tokens, step, flops / ranks / step)
for run, (method, ranks, tokens, step, rate) in rates.items():
    base = [r for m, n, _, _, r in rates.values() if m == method and n == 1]
    ratio = f", {rate / base[0]:.2f}x one GPU's" if base and ranks > 1 else ""
    print(f"{run}: step {step:.3f} s, {tokens / step:.0f} tokens/s, {rate / 1e12:.0f} TFLOP/s per GPU{ratio}")
PY
