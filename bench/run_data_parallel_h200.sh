#!/usr/bin/env bash
# Data-parallel training on one machine. First the equivalence: the tiny preset (f32, 6 steps)
# on 1 GPU with batch N and on N GPUs with batch 1 must log the same losses (the script stops
# when it cannot run). Then the scaling of `train --gpus N`: a Llama-2-7B-shape model (random
# weights, bf16), LoRA r=8 on q/k/v/o, batch 1 per GPU, random token ids, trained on 1 GPU and
# on N GPUs at each length. Per case: tokens/s (median over the steps after WARMUP, from
# metrics.jsonl), each GPU's peak (lemo's own per-rank figures, live and device-level, and the
# peak that nvidia-smi polling at 20 ms saw), the all-reduce share of the step; per length: the speed-up
# and the memory ratio. Writes RESULTS (default bench/results/h200-data-parallel.json) with the
# commands.
#
#   bench/run_data_parallel_h200.sh                   # 1 and 2 GPUs at 8K and 16K tokens per GPU
#
# env: LEMO (binary, default target/release/lemo-train), PYTHON (default python3), GPUS
#      (default 2), SEQ_LENS (default "8192 16384"), STEPS (default 8), WARMUP (default 3),
#      METHOD (default lora), COMMIT, RESULTS, LOGS (a folder to copy each run's log into),
#      WORK (a folder kept between calls: the random model is written once; default a new one),
#      SKIP_EQUIVALENCE=1 (when an earlier call over the same WORK ran it). Runs already measured
#      in WORK are kept, so a second call with more SEQ_LENS adds to the first.
set -uo pipefail
cd "$(dirname "$0")/.."
LEMO=${LEMO:-target/release/lemo-train}
PYTHON=${PYTHON:-python3}
GPUS=${GPUS:-2}
SEQ_LENS=${SEQ_LENS:-8192 16384}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
METHOD=${METHOD:-lora}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
RESULTS=${RESULTS:-bench/results/h200-data-parallel.json}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
# shellcheck source=bench/nccl_env.sh
. bench/nccl_env.sh

# 1 and GPUS, once each (GPUS=1 measures the one-GPU side alone).
RANKS=$(printf '1\n%s\n' "$GPUS" | sort -un)
COMMANDS=()
for ranks in $RANKS; do
  [ "${SKIP_EQUIVALENCE:-0}" = 1 ] && break
  batch=$(( GPUS / ranks ))
  cmd="$LEMO train --preset tiny --device cuda --precision f32 --steps 6 --val-every 3 --checkpoint-every 0 --gpus $ranks --batch-size $batch --cache-dir none --out $WORK/tiny-$ranks"
  COMMANDS+=("$cmd")
  echo "+ $cmd" >&2
  $cmd > "$WORK/tiny-$ranks.log" 2>&1 || {
    tail -5 "$WORK/tiny-$ranks.log" >&2
    [ -n "${LOGS:-}" ] && cp "$WORK"/tiny-*.log "$LOGS"/
    exit 1
  }
done

# Random weights in the Hugging Face layout, and one long document of random token ids.
[ -f "$WORK/model/model.safetensors" ] || "$PYTHON" bench/random_llama.py bench/configs/llama-2-7b.json "$WORK/model" "$WORK/data.jsonl"

for len in $SEQ_LENS; do
  for gpus in $RANKS; do
    run="$WORK/run-$len-$gpus"
    [ -f "$run/metrics.jsonl" ] && continue  # measured by an earlier call over the same WORK
    cmd="$LEMO train --model $WORK/model --data $WORK/data.jsonl --method $METHOD --seq-len $len --target-context $len --steps $STEPS --gpus $gpus --device cuda --precision bf16 --lora-rank 8 --lr 1e-4 --warmup-steps 0 --val-fraction 0 --checkpoint-every 0 --save-every 0 --cache-dir none --skip-memory-plan --out $run"
    COMMANDS+=("$cmd")
    echo "+ $cmd" >&2
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 20 > "$run.smi" 2>/dev/null &
    poller=$!
    $cmd > "$run.log" 2>&1; status=$?
    kill "$poller"; wait "$poller" 2>/dev/null
    tail -4 "$run.log" >&2
    [ $status -eq 0 ] || echo "train --gpus $gpus at $len failed (status $status)" >&2
  done
done
printf '%s\n' "${COMMANDS[@]}" >> "$WORK/commands.txt"
[ -n "${LOGS:-}" ] && cp "$WORK"/tiny-*.log "$WORK"/run-*.log "$LOGS"/
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$GPUS" "$WARMUP" "$SEQ_LENS" "$METHOD" <<'PY'
import datetime, json, os, statistics, sys
work, out, commit, gpu, gpus, warmup, lens, method = sys.argv[1:9]
gpus, warmup = int(gpus), int(warmup)
def case(length, ranks):
    run = os.path.join(work, f"run-{length}-{ranks}")
    if not os.path.exists(os.path.join(run, "metrics.jsonl")):
        return None
    steps = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if '"train"' in l]
    timed = steps[warmup:] or steps
    idle, peak = {}, {}
    for line in open(run + ".smi"):
        index, used = (int(v) for v in line.split(","))
        idle.setdefault(index, used)
        peak[index] = max(peak.get(index, 0), used)
    return {
        "ranks": ranks, "steps": len(steps),
        "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in timed),
        "step_time_s_median": statistics.median(s["step_time_s"] for s in timed),
        "allreduce_share_median": statistics.median(s["allreduce_share"] for s in timed),
        "lemo_peak_gib_by_rank": steps[-1]["mem_peak_gib_by_rank"],
        "lemo_device_peak_gib_by_rank": steps[-1].get("mem_device_peak_gib_by_rank"),
        "device_peak_gib_by_gpu": [round((peak[i] - idle[i]) / 1024, 2) for i in range(ranks)],
        "losses": [s["loss"] for s in steps],
        # --method lemo: the kept fractions, averaged over the ranks.
        "keep_attention_median": steps[0].get("keep_attention") is not None and statistics.median(s["keep_attention"] for s in timed) or None,
        "keep_mlp_median": steps[0].get("keep_mlp") is not None and statistics.median(s["keep_mlp"] for s in timed) or None,
    }
def losses(run):
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss")))
            for r in map(json.loads, open(os.path.join(work, run, "metrics.jsonl")))]
ran = gpus > 1 and os.path.exists(os.path.join(work, f"tiny-{gpus}", "metrics.jsonl"))
one, many = (losses("tiny-1"), losses(f"tiny-{gpus}")) if ran else (None, None)
equivalence = ran and {
    "what": f"tiny preset, f32, 6 steps: 1 GPU x batch {gpus} against {gpus} GPUs x batch 1",
    "one_gpu": one, f"{gpus}_gpus": many,
    "max_relative_difference": max(abs(a[2] - b[2]) / abs(a[2]) for a, b in zip(one, many)),
} or None
rows = []
for length in lens.split():
    one, many = case(length, 1), case(length, gpus)
    row = {"seq_len_per_gpu": int(length), "one_gpu": one}
    if gpus > 1:
        row[f"{gpus}_gpus"] = many
    if one and many and gpus > 1:
        row["speedup_tokens_per_s"] = many["tokens_per_s_median"] / one["tokens_per_s_median"]
        row["peak_ratio_lemo"] = max(many["lemo_peak_gib_by_rank"]) / max(one["lemo_peak_gib_by_rank"])
        row["peak_ratio_device"] = max(many["device_peak_gib_by_gpu"]) / max(one["device_peak_gib_by_gpu"])
    rows.append(row)
result = {
    "what": f"train --gpus N data-parallel scaling, Llama-2-7B shape (random weights), bf16, method {method}, LoRA r=8 q/k/v/o, batch 1 per GPU",
    "gpu": gpu, "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "commands": open(os.path.join(work, "commands.txt")).read().splitlines(),
    "equivalence": equivalence,
    "results": rows,
}
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(result, open(out, "w"), indent=1)
print(json.dumps({"equivalence": equivalence and equivalence["max_relative_difference"], "results": rows}, indent=1))
PY
