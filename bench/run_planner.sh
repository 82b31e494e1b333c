#!/usr/bin/env bash
# The planner's step at the memory limit against PEFT + Liger-Kernel's best configuration that
# fits the same card: `bench --memory-budget` for `--method lemo` and dense `lora`, every length
# in one process (the bench's own NVML watch gives each length's device-level peak), and PEFT +
# Liger without checkpointing where it fits, with checkpointing where it must, each process
# watched by nvidia-smi (20 ms, bench/device_peak.sh). Writes $RESULTS with the plan against the
# measured peak for each of our rows and the time ratios against Liger.
#
#   LEMO=target/release/lemo-train bench/run_planner.sh
#
# env: LEMO, PYTHON, CONFIG (llama-2-7b), METHODS ("lemo lora"), LENS (8192,16384,32768,65536),
#      BUDGET (76GiB), STEPS,
#      WARMUP, LIGER_PLAIN (lengths Liger fits without checkpointing on an H100: 8192),
#      LIGER_CK (16384,32768,65536), OFFLOAD ("8192:18GiB": dense lora at that length under a
#      budget that forces layer inputs to the host; empty: none), RESULTS
#      (bench/results/h100-planner.json), COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-llama-2-7b}
LENS=${LENS:-8192,16384,32768,65536}
BUDGET=${BUDGET:-76GiB}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
LIGER_PLAIN=${LIGER_PLAIN-8192}
LIGER_CK=${LIGER_CK-16384,32768,65536}
RESULTS=${RESULTS:-bench/results/h100-planner.json}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
WORK=$(mktemp -d)
source bench/device_peak.sh

SP=$("$PYTHON" -c "import site; print(site.getsitepackages()[0])")
export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
run() {  # name command...
  local name=$1; shift
  echo "+ $*" | tee -a "$WORK/commands.txt" >&2
  device_peak "$WORK/$name.peak" timeout 420 "$@" 2> >(tee "$WORK/$name.err" | grep -E "^plan:|device peak|error|Error" >&2)
}
for method in ${METHODS:-lemo lora}; do
  run "ours-$method" "$LEMO" bench --model "bench/configs/$CONFIG.json" --method $method \
    --memory-budget "$BUDGET" --seq-lens "$LENS" --steps "$STEPS" --warmup "$WARMUP" \
    --device cuda --out "$WORK/ours-$method.json" > /dev/null
done
OFFLOAD=${OFFLOAD-8192:18GiB}
if [ -n "$OFFLOAD" ]; then
  run ours-offload "$LEMO" bench --model "bench/configs/$CONFIG.json" --method lora \
    --memory-budget "${OFFLOAD##*:}" --host-memory-budget 16GiB --seq-lens "${OFFLOAD%%:*}" \
    --steps "$STEPS" --warmup "$WARMUP" --device cuda --out "$WORK/ours-offload.json" > /dev/null
fi
for ck in 0 1; do
  lens=$LIGER_PLAIN; flag=""
  [ "$ck" = 1 ] && { lens=$LIGER_CK; flag=--checkpointing; }
  [ -z "$lens" ] && continue
  run "liger-$ck" "$PYTHON" bench/reference/peft_bench.py --model "bench/configs/$CONFIG.json" \
    --method lora --liger --seq-lens "$lens" --steps "$STEPS" --warmup "$WARMUP" $flag \
    --out "$WORK/liger-$ck.json" > /dev/null
done
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$CONFIG" "$BUDGET" <<'PY'
import json, os, sys, datetime
work, out, commit, gpu, config, budget = sys.argv[1:7]
load = lambda name: json.load(open(os.path.join(work, name))) if os.path.exists(os.path.join(work, name)) else []
peak = lambda name: int(open(os.path.join(work, name)).read()) / 1024 if os.path.exists(os.path.join(work, name)) else None
ours = {m: {r["seq_len"]: r for r in load(f"ours-{m}.json")} for m in ("lemo", "lora")}
liger = {}
for ck in ("0", "1"):
    for r in load(f"liger-{ck}.json"):
        if r.get("step_time_s_median"):
            r["checkpointing"] = ck == "1"
            r["process_device_peak_gib"] = peak(f"liger-{ck}.peak")
            best = liger.get(r["seq_len"])
            if best is None or r["step_time_s_median"] < best["step_time_s_median"]:
                liger[r["seq_len"]] = r
rows = []
for length in sorted(set(ours["lemo"]) | set(ours["lora"]) | set(liger)):
    row = {"model": config, "seq_len": length, "budget": budget, "liger_best": liger.get(length)}
    for method in ("lemo", "lora"):
        r = ours[method].get(length)
        row[method] = r
        t, l = (r or {}).get("step_time_s_median"), (liger.get(length) or {}).get("step_time_s_median")
        row[f"{method}_vs_liger_time"] = t / l if t and l else None
    rows.append(row)
offload = load("ours-offload.json")
result = {"description": "lemo-train bench under the activation planner (--memory-budget) against PEFT + Liger-Kernel's fastest configuration that fits (checkpointing only where plain runs out of memory); Llama-2-7B shape, bf16, LoRA r=8 q/k/v/o, batch 1, random init; our device peaks per length by the bench's NVML watch above the idle level, Liger's per process by nvidia-smi polling (the longest length dominates)",
          "gpu": gpu, "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "commands": open(os.path.join(work, "commands.txt")).read().splitlines(), "results": rows,
          "offload": offload}
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(result, open(out, "w"), indent=2)
f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
for row in rows:
    line = f'{row["seq_len"]:>6}'
    for method in ("lemo", "lora"):
        r = row[method] or {}
        line += (f' | {method} {f(r.get("step_time_s_median"), 3)} s, {f(r.get("device_peak_gib"), 1)} GiB'
                 f' (plan {f(r.get("predicted_peak_gib"), 1)}; {r.get("plan") or r.get("error", "")}) x{f(row[method + "_vs_liger_time"])}')
    l = row["liger_best"] or {}
    line += f' | liger {f(l.get("step_time_s_median"), 3)} s ck={l.get("checkpointing")}'
    print(line)
for r in offload:
    print(f'offload {r["seq_len"]}: {f(r.get("step_time_s_median"), 3)} s, {f(r.get("device_peak_gib"), 1)} GiB (plan {f(r.get("predicted_peak_gib"), 1)}; {r.get("plan") or r.get("error")})')
print("wrote", out)
PY
[ -n "${OUT:-}" ] && cp "$RESULTS" "$WORK"/*.err "$OUT"/ 2>/dev/null
true
