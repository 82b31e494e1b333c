#!/usr/bin/env bash
# One process per GPU under a launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), on one machine of GPUS GPUs:
#   1. the tiny preset (f32, 6 steps) as GPUS processes logs the losses of the same run as GPUS
#      ranks of one process (`--gpus GPUS`);
#   2. rank 0 alone (the others never start) ends at the rendezvous after --collective-timeout;
#   3. the last rank's process killed (SIGKILL) mid-run: rank 0 ends with an error instead of
#      waiting forever.
# Writes RESULTS (default bench/results/h200-launched-ranks.json) with the commands.
#
#   bench/launched_ranks_check.sh
#
# env: LEMO (default target/release/lemo-train), PYTHON (default python3), GPUS (default 2),
#      PORT (default 29533), COMMIT, RESULTS, WORK, EXTRA (more train flags for every run, e.g.
#      "--context-parallel 2": one sequence group over the processes).
#      The tiny preset runs in f32 and its sequences split over up to 4 ranks.
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
GPUS=${GPUS:-2}
PORT=${PORT:-29533}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
RESULTS=${RESULTS:-bench/results/h200-launched-ranks.json}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
# shellcheck source=bench/nccl_env.sh
. bench/nccl_env.sh

tiny="$LEMO train --preset tiny --device cuda --precision f32 --val-every 3 --checkpoint-every 0 --batch-size 1 --cache-dir none ${EXTRA:-}"
COMMANDS=("$tiny --steps 6 --gpus $GPUS --out $WORK/threads")
$tiny --steps 6 --gpus "$GPUS" --out "$WORK/threads" > "$WORK/threads.log" 2>&1

# launch NAME SECONDS STEPS RANKS...: starts the given ranks as processes (the others never
# start) for STEPS steps; `finish NAME` waits for them (each at most SECONDS) and records each
# one's exit status and end time.
launch() {
  local name=$1 limit=$2 steps=$3
  shift 3
  local pids=()
  for rank in "$@"; do
    COMMANDS+=("RANK=$rank WORLD_SIZE=$GPUS LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT $tiny --steps $steps --collective-timeout 30s --out $WORK/$name")
    RANK=$rank WORLD_SIZE=$GPUS LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
      timeout "$limit" $tiny --steps "$steps" --collective-timeout 30s --out "$WORK/$name" > "$WORK/$name-$rank.log" 2>&1 &
    pids+=($!)
  done
  echo "${pids[*]}" > "$WORK/$name.pids"
}
finish() {
  local name=$1 i=0
  read -r -a pids < "$WORK/$name.pids"
  for pid in "${pids[@]}"; do
    wait "$pid"
    local status=$?
    echo "$i $status $(date +%s.%N)" >> "$WORK/$name.status"
    i=$((i + 1))
  done
}

launch processes 300 6 $(seq 0 $((GPUS - 1)))
finish processes

PORT=$((PORT + 1))
launch alone 120 6 0
finish alone

PORT=$((PORT + 1))
launch killed 300 100000 $(seq 0 $((GPUS - 1)))
read -r -a pids < "$WORK/killed.pids"
# Kill the last rank once training runs (rank 0's first step line), or after 60 s.
for _ in $(seq 600); do
  grep -q "^step" "$WORK/killed-0.log" 2>/dev/null && break
  sleep 0.1
done
sleep 1
killed_at=$(date +%s.%N)
# The pid is `timeout`'s: the rank is its child (killing timeout alone leaves the rank running).
pkill -9 -P "${pids[-1]}"
finish killed

printf '%s\n' "${COMMANDS[@]}" > "$WORK/commands.txt"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$GPUS" "$killed_at" "${EXTRA:-}" <<'PY'
import datetime, json, os, sys
work, out, commit, gpu, gpus, killed_at, extra = sys.argv[1:8]
def losses(run):
    path = os.path.join(work, run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in map(json.loads, open(path))]
def errors(name, rank):
    lines = open(os.path.join(work, f"{name}-{rank}.log"), errors="replace").read().splitlines()
    return [l for l in lines if l.startswith("error:")]
def status(name):
    rows = [l.split() for l in open(os.path.join(work, f"{name}.status"))]
    return {int(i): {"exit_status": int(s), "ended_at": float(t)} for i, s, t in rows}
threads, processes = losses("threads"), losses("processes")
difference = None
if threads and processes and len(threads) == len(processes):
    difference = max(abs(a[2] - b[2]) / abs(a[2]) for a, b in zip(threads, processes))
killed = status("killed")
result = {
    "what": f"train under a launcher, one process per GPU ({gpus} GPUs), against {gpus} ranks of one process" + (f", with {extra}" if extra else ""),
    "gpu": gpu, "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "commands": open(os.path.join(work, "commands.txt")).read().splitlines(),
    "equivalence": {"threads": threads, "processes": processes, "max_relative_difference": difference,
                    "exit_status": {r: s["exit_status"] for r, s in status("processes").items()}},
    "rank_0_alone": {"exit_status": status("alone")[0]["exit_status"], "errors": errors("alone", 0)},
    "last_rank_killed": {
        "rank_0_exit_status": killed[0]["exit_status"],
        "rank_0_seconds_after_the_kill": round(killed[0]["ended_at"] - float(killed_at), 1),
        "rank_0_errors": errors("killed", 0),
    },
}
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result, indent=1))
PY
