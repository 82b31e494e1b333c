#!/usr/bin/env bash
# Runs `lemo-train bench` and the PyTorch + PEFT reference (bench/reference/peft_bench.py) on the
# same configs and lengths, side by side, and merges into bench/results/h200.json both sides,
# their ratios (ours / reference: < 1 is better for time and memory), the commit and the commands:
# each row (model, method, length, checkpointing, precision) replaces the one measured before.
#
#   bench/run_h200.sh                      # Llama-2-7B dense LoRA at 4K, 8K, 16K, 32K
#   CONFIGS="llama-2-7b llama-3-8b" SEQ_LENS=4096,8192 METHODS="lora longlora" bench/run_h200.sh
#
# env: LEMO (binary, default target/release/lemo-train), PYTHON (default python3), STEPS, WARMUP,
#      CHECKPOINTING=1 (both sides recompute activations), RESULTS (default bench/results/h200.json; not OUT, which the device runner sets to its output folder),
#      PRECISION (ours: bf16, as the reference runs, or f32; default bf16), COMMIT and DIRTY
#      (provenance recorded in the results; default: from git here).
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
CK=""
[ "${CHECKPOINTING:-0}" = "1" ] && CK="--checkpointing"
WORK=$(mktemp -d)
mkdir -p "$(dirname "$RESULTS")"
COMMANDS=()
for config in $CONFIGS; do
  for method in $METHODS; do
    ours="$LEMO bench --model bench/configs/$config.json --method $method --seq-lens $SEQ_LENS --steps $STEPS --warmup $WARMUP --device cuda --precision $PRECISION $CK --out $WORK/ours-$config-$method.json"
    ref="$PYTHON bench/reference/peft_bench.py --model bench/configs/$config.json --method $method --seq-lens $SEQ_LENS --steps $STEPS --warmup $WARMUP $CK --out $WORK/ref-$config-$method.json"
    COMMANDS+=("$ours" "$ref")
    echo "+ $ours" >&2; $ours || echo "lemo-train bench failed (status $?)" >&2
    echo "+ $ref" >&2; $ref || echo "peft_bench failed (status $?)" >&2
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
for ours_path in sorted(glob.glob(os.path.join(work, "ours-*.json"))):
    key = os.path.basename(ours_path)[len("ours-"):]
    ref_path = os.path.join(work, "ref-" + key)
    ours = json.load(open(ours_path))
    ref = json.load(open(ref_path)) if os.path.exists(ref_path) else []
    by_len = {r["seq_len"]: r for r in ref}
    for o in ours:
        r = by_len.get(o["seq_len"], {})
        def ratio(k):
            a, b = o.get(k), r.get(k)
            return a / b if a and b else None
        rows.append({
            "model": o["model"], "method": o["method"], "seq_len": o["seq_len"], "checkpointing": o["checkpointing"],
            "precision": o.get("precision"),
            "commit": commit, "uncommitted_tracked_changes": int(dirty), "date": date, "commands": commands,
            "ours": o, "peft": r or None,
            "ratio_step_time": ratio("step_time_s_median"),
            "ratio_peak_memory": ratio("peak_gib"),
            "ratio_after_forward_memory": ratio("after_forward_gib"),
            "within_1.3x": (lambda t, m: None if t is None or m is None else (t <= 1.3 and m <= 1.3))(ratio("step_time_s_median"), ratio("peak_gib")),
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
    "description": "lemo-train bench vs PyTorch + PEFT (LoRA r=8 alpha=16 q/k/v/o, AdamW, batch 1, random init, PEFT in bf16); ratios are ours / PEFT; each row records the commit and commands that measured it",
    "gpu": gpu,
    "results": merged,
}
json.dump(result, open(out, "w"), indent=2)
for r in rows:
    print(f'{r["model"]:>12} {r["method"]:>9} {r["seq_len"]:>6}: time x{r["ratio_step_time"] or float("nan"):.2f} '
          f'peak x{r["ratio_peak_memory"] or float("nan"):.2f}  ours {r["ours"].get("step_time_s_median")} s '
          f'{r["ours"].get("peak_gib")} GiB oom={r["ours"]["oom"]}  peft {(r["peft"] or {}).get("step_time_s_median")} s '
          f'{(r["peft"] or {}).get("peak_gib")} GiB')
print("wrote", out)
PY
