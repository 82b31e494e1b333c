#!/usr/bin/env bash
# The memory plan against the measured device peak: `lemo-train bench` prints both for each
# case (its own NVML watch, polled every 10 ms above the idle level); nvidia-smi polling (20 ms)
# of the same process is recorded beside them as the outside figure. One process per case, so
# no case inherits another's pool. Writes bench/results/h200-memory-plan.json.
#
#   bench/memory_plan_h200.sh
#   CASES="lora:8192:0 lemo:16384:0" bench/memory_plan_h200.sh       # method:length:checkpointing
#
# env: LEMO (binary, default target/release/lemo-train), CONFIG (default llama-2-7b), STEPS,
#      WARMUP, COMMIT, RESULTS.
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
CONFIG=${CONFIG:-llama-2-7b}
CASES=${CASES:-lora:8192:0 lora:16384:0 lora:32768:1 lemo:8192:0 lemo:16384:0}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
RESULTS=${RESULTS:-bench/results/h200-memory-plan.json}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
WORK=$(mktemp -d)
source bench/device_peak.sh

for case in $CASES; do
  IFS=: read -r method len ck <<< "$case"
  flag=""; [ "$ck" = "1" ] && flag="--checkpointing"
  name="$method-$len-$ck"
  command="$LEMO bench --model bench/configs/$CONFIG.json --method $method --seq-lens $len --steps $STEPS --warmup $WARMUP --device cuda $flag --out $WORK/$name.json"
  echo "+ $command" >&2
  device_peak "$WORK/$name.peak" $command || echo "bench failed: $case" >&2
  echo "$command" > "$WORK/$name.cmd"
done

GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
python3 - "$WORK" "$RESULTS" "$COMMIT" "$GPU" $CASES <<'EOF'
import json, sys
work, out, commit, gpu, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
rows = []
for case in cases:
    method, length, ck = case.split(":")
    name = f"{method}-{length}-{ck}"
    try:
        result = json.load(open(f"{work}/{name}.json"))[0]
    except (OSError, ValueError, IndexError):
        result = {"error": "no result"}
    smi = int(open(f"{work}/{name}.peak").read()) / 1024
    predicted = result.get("predicted_peak_gib")
    rows.append({
        "method": method, "seq_len": int(length), "checkpointing": ck == "1",
        "predicted_peak_gib": predicted,
        "device_peak_gib": result.get("device_peak_gib"),
        "nvidia_smi_peak_gib": round(smi, 2),
        "predicted_vs_nvidia_smi": round((predicted - smi) / smi, 4) if predicted and smi > 0 else None,
        "pool_peak_gib": result.get("peak_gib"),
        "step_time_s_median": result.get("step_time_s_median"),
        "keep_attention": result.get("keep_attention"), "keep_mlp": result.get("keep_mlp"),
        "error": result.get("error"),
        "command": open(f"{work}/{name}.cmd").read().strip(),
    })
json.dump({
    "description": "Memory plan (crates/lemo-train/src/memory_plan.rs) against the device peak of lemo-train bench steps: device_peak_gib by bench's own NVML watch (10 ms, above the idle level), nvidia_smi_peak_gib by nvidia-smi polling (20 ms) of the same process, pool_peak_gib the CubeCL pool's bytes in use; Llama-2-7B shape, LoRA r=8 q/k/v/o, bf16, batch 1, random init",
    "gpu": gpu, "commit": commit, "script": "bench/memory_plan_h200.sh", "results": rows,
}, open(out, "w"), indent=1)
for r in rows:
    print(f"{r['method']:5} {r['seq_len']:6} ckpt={r['checkpointing']!s:5} plan {r['predicted_peak_gib']} GiB, "
          f"NVML {r['device_peak_gib']} GiB, nvidia-smi {r['nvidia_smi_peak_gib']} GiB ({r['predicted_vs_nvidia_smi']})")
EOF
