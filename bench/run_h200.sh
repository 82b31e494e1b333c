#!/usr/bin/env bash
# Runs `lemo-train bench` and the PyTorch + PEFT reference (bench/reference/peft_bench.py), plain
# and with Liger-Kernel's fused kernels, on the same configs and lengths: one process per case,
# each watched by nvidia-smi (device-level peak above the idle level, pool reservations and the
# CUDA context included) beside each framework's own figure. Merges into bench/results/h200.json
# every side, the ratios (ours / reference: < 1 is better) and the commit and commands: each row
# (model, method, length, checkpointing, precision) replaces the one measured before.
#
#   bench/run_h200.sh                      # Llama-2-7B dense LoRA at 4K, 8K, 16K, 32K
#   CONFIGS="llama-2-7b llama-3-8b" SEQ_LENS=4096,8192 METHODS="lora longlora" bench/run_h200.sh
#
# env: LEMO (binary, default target/release/lemo-train), PYTHON (default python3), STEPS, WARMUP,
#      CHECKPOINTING=1 (both sides recompute activations), REFS (default "peft peft-liger"; Liger
#      needs `pip install liger-kernel`), RESULTS (default bench/results/h200.json; not OUT, which
#      the device runner sets to its output folder), PRECISION (ours: bf16, as the reference runs,
#      or f32; default bf16), COMMIT and DIRTY (provenance recorded in the results; default: from
#      git here).
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
CONFIGS=${CONFIGS:-llama-2-7b}
METHODS=${METHODS:-lora}
SEQ_LENS=${SEQ_LENS:-4096,8192,16384,32768}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
PRECISION=${PRECISION:-bf16}
RESULTS=${RESULTS:-bench/results/h200.json}
REFS=${REFS:-peft peft-liger}
CK=""
[ "${CHECKPOINTING:-0}" = "1" ] && CK="--checkpointing"
WORK=$(mktemp -d)
mkdir -p "$(dirname "$RESULTS")"
source bench/device_peak.sh
COMMANDS=()
for config in $CONFIGS; do
  for method in $METHODS; do
    for len in ${SEQ_LENS//,/ }; do
      key="$config-$method-$len"
      ours="$LEMO bench --model bench/configs/$config.json --method $method --seq-lens $len --steps $STEPS --warmup $WARMUP --device cuda --precision $PRECISION $CK --out $WORK/ours-$key.json"
      COMMANDS+=("$ours")
      echo "+ $ours" >&2; device_peak "$WORK/ours-$key.peak" $ours || echo "lemo-train bench failed (status $?)" >&2
      for ref in $REFS; do
        liger=""; [ "$ref" = "peft-liger" ] && liger="--liger"
        command="$PYTHON bench/reference/peft_bench.py --model bench/configs/$config.json --method $method --seq-lens $len --steps $STEPS --warmup $WARMUP $CK $liger --out $WORK/$ref-$key.json"
        COMMANDS+=("$command")
        echo "+ $command" >&2; device_peak "$WORK/$ref-$key.peak" $command || echo "$ref failed (status $?)" >&2
      done
    done
  done
done
# The device machine's copy of the tree may carry a stale .git: pass COMMIT (and DIRTY=0) from
# the checkout the binary was built from.
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
DIRTY=${DIRTY:-$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)}
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
printf '%s\n' "${COMMANDS[@]}" > "$WORK/commands.txt"
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$DIRTY" "$GPU" <<'PY'
import glob, json, os, sys, datetime
work, out, commit, dirty, gpu = sys.argv[1:6]
rows = []
commands = open(os.path.join(work, "commands.txt")).read().splitlines()
date = datetime.datetime.now(datetime.timezone.utc).isoformat()
sys.path.insert(0, "bench")
from bench_files import device_peak_gib, first_result
for ours_path in sorted(glob.glob(os.path.join(work, "ours-*.json"))):
    key = os.path.basename(ours_path)[len("ours-"):-len(".json")]
    o = first_result(ours_path)
    if o is None:
        continue
    o["device_peak_gib_nvidia_smi"] = device_peak_gib(os.path.join(work, f"ours-{key}.peak"))
    refs = {}
    for ref in ("peft", "peft-liger"):
        r = first_result(os.path.join(work, f"{ref}-{key}.json"))
        if r is not None:
            r["device_peak_gib_nvidia_smi"] = device_peak_gib(os.path.join(work, f"{ref}-{key}.peak"))
        refs[ref.replace("-", "_")] = r
    def ratio(ref, k):
        a, b = o.get(k), (refs.get(ref) or {}).get(k)
        return a / b if a and b else None
    rows.append({
        "model": o["model"], "method": o["method"], "seq_len": o["seq_len"], "checkpointing": o["checkpointing"],
        "precision": o.get("precision"),
        "commit": commit, "uncommitted_tracked_changes": int(dirty), "date": date,
        "commands": [c for c in commands if f"-{key}.json" in c],
        "ours": o, **refs,
        "ratio_step_time": ratio("peft", "step_time_s_median"),
        "ratio_device_peak": ratio("peft", "device_peak_gib_nvidia_smi"),
        "ratio_step_time_vs_liger": ratio("peft_liger", "step_time_s_median"),
        "ratio_device_peak_vs_liger": ratio("peft_liger", "device_peak_gib_nvidia_smi"),
        "ratio_peak_memory": ratio("peft", "peak_gib"),
    })
row_key = lambda r: (r["model"], r["method"], r["seq_len"], r["checkpointing"], r.get("precision"))
previous = json.load(open(out)) if os.path.exists(out) else {"results": []}
for old in previous["results"]:
    # Rows from before rows carried their own provenance get the file's.
    for field in ("commit", "uncommitted_tracked_changes", "date", "commands"):
        old.setdefault(field, previous.get(field))
new_keys = {row_key(r) for r in rows}
merged = [r for r in previous["results"] if row_key(r) not in new_keys] + rows
merged.sort(key=lambda r: tuple(str(v) for v in row_key(r)[:2]) + (r["seq_len"], r["checkpointing"]))
result = {
    "description": "lemo-train bench vs PyTorch + PEFT and PEFT + Liger-Kernel (LoRA r=8 alpha=16 q/k/v/o, AdamW, batch 1, random init, bf16), one process per case; device_peak_gib_nvidia_smi: nvidia-smi polling (20 ms) above the idle level; ratios are ours / reference (ratio_peak_memory: each framework's own figure); each row records the commit and commands that measured it",
    "gpu": gpu,
    "results": merged,
}
json.dump(result, open(out, "w"), indent=2)
fmt = lambda v: "n/a" if v is None else f"{v:.2f}"
for r in rows:
    print(f'{r["model"]:>12} {r["method"]:>9} {r["seq_len"]:>6} ck={r["checkpointing"]}: vs PEFT time x{fmt(r["ratio_step_time"])} '
          f'device peak x{fmt(r["ratio_device_peak"])}; vs PEFT+Liger time x{fmt(r["ratio_step_time_vs_liger"])} '
          f'device peak x{fmt(r["ratio_device_peak_vs_liger"])}; ours {r["ours"].get("step_time_s_median")} s '
          f'{fmt(r["ours"].get("device_peak_gib_nvidia_smi"))} GiB (live {fmt(r["ours"].get("peak_gib"))})')
print("wrote", out)
PY
