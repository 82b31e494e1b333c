#!/usr/bin/env bash
# Bad input and failures of `train --gpus N` on a machine with N GPUs, each with the line the
# user sees, its exit status and (for the dying rank) how long the surviving rank took to end:
#   1. --gpus N+1: refused before anything loads;
#   2. a run checkpointed on N ranks and resumed on 1: refused, and the checkpoint's files are
#      byte-identical afterwards;
#   3. a rank that dies mid-step: GPU 1 is filled by another process until the 7B-shape model
#      at SEQ tokens no longer fits there, so rank 1 runs out of memory in its forward pass while
#      rank 0 reaches the gradient sum; rank 0 must end with the reason, not hang.
# Writes RESULTS (default bench/results/h200-data-parallel-faults.json).
#
#   bench/data_parallel_faults.sh
#
# env: LEMO (default target/release/lemo-train), PYTHON (default python3), GPUS (default 2),
#      SEQ (default 16384), WORK (a folder kept between calls; the random model is written once),
#      COMMIT, RESULTS.
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
GPUS=${GPUS:-2}
SEQ=${SEQ:-16384}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
RESULTS=${RESULTS:-bench/results/h200-data-parallel-faults.json}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
# shellcheck source=bench/nccl_env.sh
. bench/nccl_env.sh

CASES="$WORK/fault-cases.jsonl"
: > "$CASES"
# case NAME EXPECT(0 ok, 1 failure wanted) COMMAND...: runs it, records status, seconds, last line.
case_run() {
  local name=$1 expect=$2
  shift 2
  echo "+ $*" >&2
  local start end status
  start=$(date +%s.%N)
  # Each line stamped with the time it came out: how long the run took to end after its error.
  "$@" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$WORK/$name.log"
  status=${PIPESTATUS[0]}
  end=$(date +%s.%N)
  tail -3 "$WORK/$name.log" | cut -d' ' -f2- >&2
  "$PYTHON" - "$name" "$expect" "$status" "$start" "$end" "$WORK/$name.log" "$*" >> "$CASES" <<'PY'
import json, sys
name, expect, status, start, end, log, command = sys.argv[1:8]
stamped = [l.split(" ", 1) for l in open(log, errors="replace").read().splitlines()]
errors = [(float(t), l) for t, l in (s for s in stamped if len(s) == 2) if l.startswith("error:")]
print(json.dumps({
    "case": name, "command": command, "exit_status": int(status),
    "seconds": round(float(end) - float(start), 1),
    "error_lines": [l for _, l in errors],
    "seconds_from_first_error_to_exit": round(float(end) - errors[0][0], 1) if errors else None,
    "as_expected": (int(status) != 0) == (expect == "1") and (expect == "0" or len(errors) == 1),
}))
PY
}

tiny="$LEMO train --preset tiny --device cuda --precision f32 --cache-dir none"
case_run too_many_gpus 1 $tiny --steps 2 --gpus $((GPUS + 1)) --out "$WORK/too-many"

rm -rf "$WORK/resume"
case_run checkpointed_on_n_ranks 0 $tiny --steps 4 --checkpoint-every 2 --stop-after 2 --gpus "$GPUS" --out "$WORK/resume"
before=$(cd "$WORK/resume" && find checkpoints -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum)
case_run resume_on_one_rank 1 $LEMO train --resume "$WORK/resume" --gpus 1
after=$(cd "$WORK/resume" && find checkpoints -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum)

[ -f "$WORK/model/model.safetensors" ] || "$PYTHON" bench/random_llama.py bench/configs/llama-2-7b.json "$WORK/model" "$WORK/data.jsonl"
# Leave GPU 1 a third of what the run needs (about 77 GiB at 16K, 46 GiB at 8K).
"$PYTHON" - <<'PY' &
import time, torch
free, _ = torch.cuda.mem_get_info(1)
hog = torch.empty(free - (26 << 30), dtype=torch.uint8, device="cuda:1")
open("/tmp/lemo-hog-ready", "w").close()
time.sleep(600)
PY
hog=$!
while [ ! -f /tmp/lemo-hog-ready ]; do sleep 1; done
rm -f /tmp/lemo-hog-ready
case_run rank_1_out_of_memory 1 $LEMO train --model "$WORK/model" --data "$WORK/data.jsonl" --seq-len "$SEQ" --target-context "$SEQ" --steps 4 --gpus "$GPUS" --device cuda --precision bf16 --lora-rank 8 --val-fraction 0 --checkpoint-every 0 --save-every 0 --cache-dir none --skip-memory-plan --collective-timeout 2m --out "$WORK/oom"
kill "$hog"; wait "$hog" 2>/dev/null

GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
"$PYTHON" - "$CASES" "$RESULTS" "$COMMIT" "$GPU" "$GPUS" "$([ "$before" = "$after" ] && echo true || echo false)" <<'PY'
import datetime, json, os, sys
cases, out, commit, gpu, gpus, intact = sys.argv[1:7]
rows = [json.loads(l) for l in open(cases)]
result = {
    "what": f"train --gpus {gpus}: bad input and a rank that dies mid-step",
    "gpu": gpu, "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "cases": rows,
    "checkpoint_intact_after_refused_resume": intact == "true",
}
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result, indent=1))
PY
