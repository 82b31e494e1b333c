#!/usr/bin/env bash
# A/B of two lemo-train binaries on the same `bench` cases, one process per case, alternating
# A and B: step time, the pool's own peak (live tensors) and the device-level peak by
# nvidia-smi polling (20 ms, above the idle level). Merges rows into $RESULTS.
#
#   A=/tmp/lemo-train B=/tmp/lemo-train-b LABEL_A=sub-slices LABEL_B=exclusive bench/binary_ab.sh
#   CASES="lemo:8192:0 lora:32768:1" ...                    # method:length:checkpointing
#
# env: A, B (binaries), LABEL_A, LABEL_B, CASES, CONFIG (default llama-2-7b), STEPS, WARMUP,
#      LEMO_FLAGS (flags of the lemo cases, default "--target-keep 0.5"), COMMIT, RESULTS.
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-llama-2-7b}
CASES=${CASES:-lemo:8192:0 lora:8192:0 lora:32768:1}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-2}
LEMO_FLAGS=${LEMO_FLAGS:---target-keep 0.5}
LABEL_A=${LABEL_A:-a}
LABEL_B=${LABEL_B:-b}
RESULTS=${RESULTS:-bench/results/h200-binary-ab.json}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
WORK=$(mktemp -d)
source bench/device_peak.sh

for case in $CASES; do
  IFS=: read -r method len ck <<< "$case"
  flag=""; [ "$ck" = "1" ] && flag="--checkpointing"
  [ "$method" = "lemo" ] && flag="$flag $LEMO_FLAGS"
  for side in A B; do
    bin=${!side}
    cmd="$bin bench --model bench/configs/$CONFIG.json --method $method --seq-lens $len --steps $STEPS --warmup $WARMUP --device cuda $flag --out $WORK/$side-$method-$len-$ck.json"
    echo "+ $cmd" >&2
    device_peak "$WORK/$side-$method-$len-$ck.peak" $cmd || echo "bench failed: $cmd" >&2
    echo "$side $cmd" >> "$WORK/commands.txt"
  done
done
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
python3 - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$CONFIG" "$LABEL_A" "$LABEL_B" <<'PY'
import glob, json, os, sys, datetime
work, out, commit, gpu, config, label_a, label_b = sys.argv[1:8]
commands = open(os.path.join(work, "commands.txt")).read().splitlines()
sys.path.insert(0, "bench")
from bench_files import device_peak_gib, first_result
rows = []
for a_path in sorted(glob.glob(os.path.join(work, "A-*.json"))):
    key = os.path.basename(a_path)[2:-5]
    method, length, ck = key.split("-")
    row = {"model": config, "method": method, "seq_len": int(length), "checkpointing": ck == "1",
           "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "commands": [c for c in commands if f"-{key}.json" in c]}
    for side, label in (("A", label_a), ("B", label_b)):
        bench = first_result(os.path.join(work, f"{side}-{key}.json")) or {}
        row[label] = {"device_peak_gib": device_peak_gib(os.path.join(work, f"{side}-{key}.peak")),
                      "bench_device_peak_gib": bench.get("device_peak_gib"),
                      "live_peak_gib": bench.get("peak_gib"),
                      "step_time_s_median": bench.get("step_time_s_median"),
                      "keep_attention": bench.get("keep_attention"), "keep_mlp": bench.get("keep_mlp"),
                      "error": bench.get("error")}
    rows.append(row)
    a, b = row[label_a], row[label_b]
    print(f"{method} {length} ck={ck}: {label_a} device {a['device_peak_gib']} live {a['live_peak_gib']} step {a['step_time_s_median']} | "
          f"{label_b} device {b['device_peak_gib']} live {b['live_peak_gib']} step {b['step_time_s_median']}")
try:
    doc = json.load(open(out))
except (OSError, ValueError):
    doc = {"description": "two lemo-train binaries on the same bench cases; device peaks by nvidia-smi polling above the idle level", "results": []}
doc["gpu"] = gpu
doc["results"].extend(rows)
json.dump(doc, open(out, "w"), indent=1)
PY
