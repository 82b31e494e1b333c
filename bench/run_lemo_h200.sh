#!/usr/bin/env bash
# `--method lemo` (token elimination; --target-keep F keeps 1.4 F of the attention blocks' and
# F / 2 of the MLP blocks' token blocks) against
# PyTorch + PEFT dense LoRA on the same shapes, one process per case, with the device-level peak
# of every process taken by nvidia-smi polling (20 ms) beside each framework's own figure (lemo:
# its pool's bytes in use; PEFT: torch.cuda.max_memory_allocated). Merges into
# bench/results/h200-lemo.json, each row with its commit and commands.
#
#   bench/run_lemo_h200.sh                                  # 8K and 16K, then 32K checkpointed
#   CASES="8192:0 16384:0" bench/run_lemo_h200.sh           # length:checkpointing
#
# env: LEMO (binary, default target/release/lemo-train), PYTHON, CONFIG (default llama-2-7b),
#      STEPS, WARMUP, TARGET_KEEP (default 0.5), SCORES (exact, or predicted: untrained predictors of
#      the default size, whose time and memory are a trained set's), COMMIT, RESULTS (default
#      bench/results/h200-lemo.json).
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-llama-2-7b}
CASES=${CASES:-8192:0 16384:0 32768:1}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-2}
TARGET_KEEP=${TARGET_KEEP:-0.5}
SCORES=${SCORES:-exact}
RESULTS=${RESULTS:-bench/results/h200-lemo.json}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
WORK=$(mktemp -d)

source bench/device_peak.sh

for case in $CASES; do
  len=${case%%:*}; ck=${case##*:}
  flag=""; [ "$ck" = "1" ] && flag="--checkpointing"
  ours="$LEMO bench --model bench/configs/$CONFIG.json --method lemo --scores $SCORES --target-keep $TARGET_KEEP --seq-lens $len --steps $STEPS --warmup $WARMUP --device cuda $flag --out $WORK/ours-$len-$ck.json"
  ref="$PYTHON bench/reference/peft_bench.py --model bench/configs/$CONFIG.json --method lora --seq-lens $len --steps $STEPS --warmup $WARMUP $flag --out $WORK/peft-$len-$ck.json"
  echo "+ $ours" >&2; device_peak "$WORK/ours-$len-$ck.peak" $ours || echo "lemo bench failed" >&2
  echo "+ $ref" >&2; device_peak "$WORK/peft-$len-$ck.peak" $ref || echo "peft bench failed" >&2
  echo "$ours" >> "$WORK/commands.txt"; echo "$ref" >> "$WORK/commands.txt"
done
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$CONFIG" "$SCORES" <<'PY'
import glob, json, os, sys, datetime
work, out, commit, gpu, config, scores = sys.argv[1:7]
commands = open(os.path.join(work, "commands.txt")).read().splitlines()
sys.path.insert(0, "bench")
from bench_files import device_peak_gib, first_result
rows = []
for ours_path in sorted(glob.glob(os.path.join(work, "ours-*.json"))):
    key = os.path.basename(ours_path)[len("ours-"):-len(".json")]
    length, ck = key.split("-")
    ours, peft = first_result(ours_path), first_result(os.path.join(work, f"peft-{key}.json"))
    ours_peak, peft_peak = device_peak_gib(os.path.join(work, f"ours-{key}.peak")), device_peak_gib(os.path.join(work, f"peft-{key}.peak"))
    ratio = lambda a, b: a / b if a and b else None
    rows.append({
        "model": config, "seq_len": int(length), "checkpointing": ck == "1", "scores": scores,
        "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "commands": [c for c in commands if f"--seq-lens {length} " in c and (ck == "1") == ("--checkpointing" in c)],
        "keep_attention": (ours or {}).get("keep_attention"), "keep_mlp": (ours or {}).get("keep_mlp"),
        "ours_device_peak_gib": ours_peak, "peft_device_peak_gib": peft_peak,
        "ratio_step_time": ratio((ours or {}).get("step_time_s_median"), (peft or {}).get("step_time_s_median")),
        "ratio_device_peak": ratio(ours_peak, peft_peak),
        "ours": ours, "peft": peft,
    })
previous = json.load(open(out)) if os.path.exists(out) else {"results": []}
key = lambda r: (r["model"], r["seq_len"], r["checkpointing"], r.get("scores", "exact"))
new = {key(r) for r in rows}
merged = sorted([r for r in previous["results"] if key(r) not in new] + rows, key=key)
json.dump({"description": "lemo-train bench --method lemo vs PyTorch + PEFT dense LoRA (r=8, alpha=16, q/k/v/o, bf16, batch 1, random init, AdamW); device peaks by nvidia-smi polling above the idle level; ratios are ours / PEFT",
           "gpu": gpu, "results": merged}, open(out, "w"), indent=2)
for r in rows:
    print(f'{r["seq_len"]:>6} ck={r["checkpointing"]!s:5} {scores} keep {r["keep_attention"]}/{r["keep_mlp"]}: '
          f'time x{r["ratio_step_time"] or float("nan"):.2f} device peak x{r["ratio_device_peak"] or float("nan"):.2f} '
          f'(ours {(r["ours"] or {}).get("step_time_s_median")} s {r["ours_device_peak_gib"]} GiB, '
          f'peft {(r["peft"] or {}).get("step_time_s_median")} s {r["peft_device_peak_gib"]} GiB)')
print("wrote", out)
PY
[ -n "${OUT:-}" ] && cp "$RESULTS" "$OUT"/ || true
