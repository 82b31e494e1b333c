#!/usr/bin/env bash
# Data-parallel training on one machine. First the equivalence: the tiny preset (f32, 6 steps)
# on 1 GPU with batch N and on N GPUs with batch 1 must log the same losses (the script stops
# when it cannot run). Then the scaling of `train --gpus N`: a Llama-2-7B-shape model (random
# weights, bf16), LoRA r=8 on q/k/v/o, batch 1 per GPU, random token ids, trained on 1 GPU and
# on N GPUs at each length. Per case: tokens/s (median over the steps after WARMUP, from
# metrics.jsonl), each GPU's peak (lemo's own per-rank figure and the device-level peak that
# nvidia-smi polling at 20 ms saw), the all-reduce share of the step; per length: the speed-up
# and the memory ratio. Writes RESULTS (default bench/results/h200-data-parallel.json) with the
# commands.
#
#   bench/run_data_parallel_h200.sh                   # 1 and 2 GPUs at 8K and 16K tokens per GPU
#
# env: LEMO (binary, default target/release/lemo-train), PYTHON (default python3), GPUS
#      (default 2), SEQ_LENS (default "8192 16384"), STEPS (default 8), WARMUP (default 3),
#      METHOD (default lora), COMMIT, RESULTS, LOGS (a folder to copy each run's log into).
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
WORK=$(mktemp -d)
export NCCL_NVLS_ENABLE=0

# NCCL from pip's wheel (or wherever the system has it), under the name it is loaded by.
NCCL_SO=$("$PYTHON" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
[ -f "$NCCL_SO" ] || NCCL_SO=$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)
mkdir -p "$WORK/nccl" && ln -sf "$NCCL_SO" "$WORK/nccl/libnccl.so"
export LD_LIBRARY_PATH="$WORK/nccl:${LD_LIBRARY_PATH:-}"
echo "NCCL: $NCCL_SO" >&2

# 1 and GPUS, once each (GPUS=1 measures the one-GPU side alone).
RANKS=$(printf '1\n%s\n' "$GPUS" | sort -un)
COMMANDS=()
for ranks in $RANKS; do
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
"$PYTHON" - "$WORK/model" "$WORK/data.jsonl" <<'PY'
import json, os, sys, torch
from safetensors.torch import save_file
out, data = sys.argv[1:3]
cfg = json.load(open("bench/configs/llama-2-7b.json"))
os.makedirs(out, exist_ok=True)
json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
h, f, layers, vocab = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
g = torch.Generator(device="cuda").manual_seed(0)
def w(*shape):
    return (torch.randn(*shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16).cpu()
ones = lambda: torch.ones(h, dtype=torch.bfloat16)
t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": ones(), "lm_head.weight": w(vocab, h)}
for i in range(layers):
    p = f"model.layers.{i}."
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        t[p + f"self_attn.{n}.weight"] = w(h, h)
    t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(f, h), w(f, h)
    t[p + "mlp.down_proj.weight"] = w(h, f)
    t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = ones(), ones()
save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
ids = torch.randint(3, vocab, (1 << 20,), generator=torch.Generator().manual_seed(1)).tolist()
open(data, "w").write(json.dumps({"input_ids": ids}) + "\n")
PY

for len in $SEQ_LENS; do
  for gpus in $RANKS; do
    run="$WORK/run-$len-$gpus"
    cmd="$LEMO train --model $WORK/model --data $WORK/data.jsonl --method $METHOD --seq-len $len --steps $STEPS --gpus $gpus --device cuda --precision bf16 --lora-rank 8 --lr 1e-4 --warmup-steps 0 --val-fraction 0 --checkpoint-every 0 --save-every 0 --cache-dir none --skip-memory-plan --out $run"
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
printf '%s\n' "${COMMANDS[@]}" > "$WORK/commands.txt"
[ -n "${LOGS:-}" ] && cp "$WORK"/tiny-*.log "$WORK"/run-*.log "$LOGS"/
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
"$PYTHON" - "$WORK" "$RESULTS" "$COMMIT" "$GPU" "$GPUS" "$WARMUP" "$SEQ_LENS" <<'PY'
import datetime, json, os, statistics, sys
work, out, commit, gpu, gpus, warmup, lens = sys.argv[1:8]
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
        "device_peak_gib_by_gpu": [round((peak[i] - idle[i]) / 1024, 2) for i in range(ranks)],
        "losses": [s["loss"] for s in steps],
    }
def losses(run):
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss")))
            for r in map(json.loads, open(os.path.join(work, run, "metrics.jsonl")))]
one, many = losses("tiny-1"), losses(f"tiny-{gpus}")
equivalence = gpus > 1 and {
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
    "what": "train --gpus N data-parallel scaling, Llama-2-7B shape (random weights), bf16, LoRA r=8 q/k/v/o, batch 1 per GPU",
    "gpu": gpu, "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "commands": open(os.path.join(work, "commands.txt")).read().splitlines(),
    "equivalence": equivalence,
    "results": rows,
}
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(result, open(out, "w"), indent=1)
print(json.dumps({"equivalence": equivalence and equivalence["max_relative_difference"], "results": rows}, indent=1))
PY
