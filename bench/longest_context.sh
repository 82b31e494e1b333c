#!/usr/bin/env bash
# The longest context each side trains on one GPU: `lemo` under its planner (default device
# budget, layer inputs offloaded to host memory where the device cannot hold them) against
# PEFT + Liger-Kernel with gradient checkpointing, Llama-3-8B shape (bf16, LoRA r=8 q/k/v/o,
# batch 1, random weights).
#
# A full-depth step past 256K tokens runs longer than a device call allows, so each side is
# measured at a reduced depth (LAYERS) and carried to the full depth by what scales with it:
# - `lemo`: its planner's plan for the full model (`bench --plan-only`: the plan line, or the
#   one-line refusal), trusted as far as its plan meets the measured device peak at the reduced
#   depth (the plan is a sum over layers plus one layer's working set, both measured there).
# - Liger: with checkpointing, each further layer adds its bf16 weights and its checkpointed
#   input (S x hidden x 2 bytes); the rest of the peak is one layer's recomputation and the loss.
#   LIGER_CHECK runs one length at full depth to check that rule.
# Every process is watched by nvidia-smi (20 ms, bench/device_peak.sh); `bench` also polls NVML.
#
#   LEMO=target/release/lemo-train bench/longest_context.sh
#
# env: LEMO, PYTHON, CONFIG (llama-3-8b), LAYERS (4), PLAN_LENS (full-depth plans), LENS (lemo
#      at reduced depth), LIGER_LENS (Liger at reduced depth), LIGER_CHECK (a length Liger runs
#      at full depth; empty: none), SIDES ("lemo liger"), STEPS (1), WARMUP (0), EXTRA (more
#      `bench` arguments for the reduced-depth runs), RESULTS, COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-llama-3-8b}
LAYERS=${LAYERS:-4}
PLAN_LENS=${PLAN_LENS:-131072,262144,393216,524288,655360,786432}
LENS=${LENS:-131072,262144,524288}
LIGER_LENS=${LIGER_LENS:-131072,262144,393216,524288}
LIGER_CHECK=${LIGER_CHECK-65536}
STEPS=${STEPS:-1}
WARMUP=${WARMUP:-0}
RESULTS=${RESULTS:-bench/results/h200-longest-context.json}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
WORK=${WORK:-$(mktemp -d)}
source bench/device_peak.sh

SP=$("$PYTHON" -c "import site; print(site.getsitepackages()[0])")
export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
FULL=bench/configs/$CONFIG.json
REDUCED=$WORK/$CONFIG-$LAYERS-layers.json
"$PYTHON" - "$FULL" "$REDUCED" "$LAYERS" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["num_hidden_layers"] = int(sys.argv[3])
json.dump(config, open(sys.argv[2], "w"))
PY
run() {  # name command...
  local name=$1; shift
  echo "+ $*" | tee -a "$WORK/commands.txt" >&2
  device_peak "$WORK/$name.peak" timeout 560 "$@" 2> >(tee "$WORK/$name.err" | grep -E "^plan:|device peak|rror|refus" >&2)
}
for side in ${SIDES:-lemo liger}; do
  if [ "$side" = lemo ]; then
    run lemo-plan "$LEMO" bench --model "$FULL" --method lemo --seq-lens "$PLAN_LENS" --plan-only \
      --device cuda --out "$WORK/lemo-plan.json" > /dev/null
    for len in ${LENS//,/ }; do
      run "lemo-$len" "$LEMO" bench --model "$REDUCED" --method lemo --seq-lens "$len" \
        --steps "$STEPS" --warmup "$WARMUP" ${EXTRA:-} --device cuda --out "$WORK/lemo-$len.json" > /dev/null
    done
  else
    for len in ${LIGER_LENS//,/ }; do
      run "liger-$len" "$PYTHON" bench/reference/peft_bench.py --model "$REDUCED" --method lora \
        --liger --checkpointing --seq-lens "$len" --steps "$STEPS" --warmup "$WARMUP" \
        --out "$WORK/liger-$len.json" > /dev/null
    done
    if [ -n "$LIGER_CHECK" ]; then
      for model in "$FULL" "$REDUCED"; do
        tag=$([ "$model" = "$FULL" ] && echo full || echo reduced)
        run "liger-check-$tag" "$PYTHON" bench/reference/peft_bench.py --model "$model" --method lora \
          --liger --checkpointing --seq-lens "$LIGER_CHECK" --steps "$STEPS" --warmup "$WARMUP" \
          --out "$WORK/liger-check-$tag.json" > /dev/null
      done
    fi
  fi
done
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$FULL" "$LAYERS" <<'PY'
import glob, json, os, sys, datetime
work, out, commit, gpu, full, layers = sys.argv[1:7]
config = json.load(open(full))
hidden, depth = config["hidden_size"], config["num_hidden_layers"]
inter, heads, kv = config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]
layer_weights = 2 * (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * inter)
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return []
def peak(name):
    try:
        return int(open(os.path.join(work, name + ".peak")).read()) / 1024
    except (OSError, ValueError):
        return None
record = {
    "description": "Longest context on one GPU, measured at reduced depth and carried to full depth (bench/longest_context.sh header says how).",
    "device": gpu, "commit": commit, "date": datetime.date.today().isoformat(),
    "model": os.path.basename(full), "reduced_layers": int(layers),
    "commands": open(os.path.join(work, "commands.txt")).read().splitlines() if os.path.exists(os.path.join(work, "commands.txt")) else [],
    "lemo_full_depth_plans": [{k: r.get(k) for k in ("seq_len", "plan", "predicted_peak_gib", "activation_plan", "error")} for r in load(os.path.join(work, "lemo-plan.json"))],
    "lemo_reduced": [], "liger_reduced": [], "liger_check": {},
}
for path in sorted(glob.glob(os.path.join(work, "lemo-[0-9]*.json")), key=lambda p: int(p.split("-")[-1][:-5])):
    name = os.path.basename(path)[:-5]
    for r in load(path):
        r["process_device_peak_gib"] = peak(name)
        record["lemo_reduced"].append(r)
extra = lambda s: (depth - int(layers)) * (layer_weights + s * hidden * 2) / 2**30
for path in sorted(glob.glob(os.path.join(work, "liger-[0-9]*.json")), key=lambda p: int(p.split("-")[-1][:-5])):
    name = os.path.basename(path)[:-5]
    for r in load(path):
        r["process_device_peak_gib"] = peak(name)
        if r["process_device_peak_gib"] is not None and not r.get("oom"):
            r["full_depth_device_peak_gib"] = r["process_device_peak_gib"] + extra(r["seq_len"])
        record["liger_reduced"].append(r)
for tag in ("full", "reduced"):
    for r in load(os.path.join(work, f"liger-check-{tag}.json")):
        r["process_device_peak_gib"] = peak(f"liger-check-{tag}")
        record["liger_check"][tag] = r
check = record["liger_check"]
if all(check.get(t, {}).get("process_device_peak_gib") for t in ("full", "reduced")):
    predicted = check["reduced"]["process_device_peak_gib"] + extra(check["reduced"]["seq_len"])
    check["rule_error"] = predicted / check["full"]["process_device_peak_gib"] - 1
json.dump(record, open(out, "w"), indent=1)
print(json.dumps(record, indent=1)[:6000])
PY
