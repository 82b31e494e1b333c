#!/usr/bin/env bash
# `bench --method lemo` under several flag sets on the Llama-2-7B shape, one process per case
# watched by nvidia-smi (bench/device_peak.sh), then PEFT + Liger-Kernel with checkpointing on
# the same lengths: the issue-41 table (lemo against lemo --s2, with and without LongLoRA's
# trainable embeddings and norms) in one device call; other peers of PyTorch + PEFT by PEERS
# (issue 43: QLoRA's bitsandbytes base). Each case's bench JSON and the commands go to $OUT
# (default: a temporary folder), a summary line per length to stdout.
#
#   LEMO=target/release/lemo-train CASES="lemo|32768,65536|;lemo-s2|32768|--s2" bench/lemo_cases.sh
#   CONFIG=llama-3-8b CASES="q4k|8192|--quantize-base q4_k" PEERS="bnb-ck|8192|--load-in-4bit --checkpointing" \
#     bench/lemo_cases.sh
#
# env: LEMO, CONFIG (llama-2-7b), LENS (32768,65536: the default cases' and peers' lengths),
#      CASES ("name|lengths|extra bench flags;...", empty: none), PEERS (the same for bench/reference/peft_bench.py,
#      default "liger-ck|$LENS|--liger --checkpointing"; empty: none), OUT.
set -u
cd "$(dirname "$0")/.."
source bench/device_peak.sh
LEMO=${LEMO:-target/release/lemo-train}
CONFIG=${CONFIG:-llama-2-7b}
LENS=${LENS:-32768,65536}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
IFS=';' read -r -a cases <<<"${CASES-lemo|$LENS|;lemo-s2|$LENS|--s2}"
for case in "${cases[@]}"; do
  IFS='|' read -r name lens flags <<<"$case"
  # shellcheck disable=SC2086 # the case's flags are meant to split
  set -- "$LEMO" bench --model "bench/configs/$CONFIG.json" --method lemo $flags --seq-lens "$lens" \
    --steps 2 --warmup 1 --device cuda --out "$OUT/$name.json"
  echo "+ $*" | tee -a "$OUT/commands.txt"
  device_peak "$OUT/$name.peak" timeout 300 "$@" 2>&1 | grep -E "^plan:|^bench:|^error" | tail -8
done
IFS=';' read -r -a peers <<<"${PEERS-liger-ck|$LENS|--liger --checkpointing}"
for peer in "${peers[@]}"; do
  IFS='|' read -r name lens flags <<<"$peer"
  # shellcheck disable=SC2086
  set -- python3 bench/reference/peft_bench.py --model "bench/configs/$CONFIG.json" --method lora \
    $flags --seq-lens "$lens" --steps 2 --warmup 1 --out "$OUT/$name.json"
  echo "+ $*" | tee -a "$OUT/commands.txt"
  device_peak "$OUT/$name.peak" timeout 300 "$@" 2>&1 | tail -2
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(path)[:-5]
    peak = os.path.join(out, name + ".peak")
    process_peak = int(open(peak).read()) / 1024 if os.path.exists(peak) else None
    for r in json.load(open(path)):
        print(name, r.get("seq_len"), "step", r.get("step_time_s_median"), "s; device peak",
              r.get("device_peak_gib"), "GiB; plan", r.get("predicted_peak_gib"),
              "; process peak", process_peak, "GiB", r.get("error") or "")
PY
