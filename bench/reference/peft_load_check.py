#!/usr/bin/env python3
"""Load a lemo-trained adapter with Hugging Face PEFT and compute the same loss as `lemo-train eval`.

The adapter folder is PEFT's own format (adapter_config.json + adapter_model.safetensors); lemo adds
`lemo_training.json`, which records the RoPE scaling the adapter was trained with (position
interpolation for --target-context). This script applies that scaling to the base model's config,
loads the adapter with `PeftModel.from_pretrained`, and scores token ids the way `eval` does:
documents no longer than --seq-len in one window, longer ones in windows of --seq-len every
--stride tokens; the loss is the mean next-token cross-entropy over all scored predictions.

    python bench/reference/peft_load_check.py --model runs/tiny/base-model --adapter runs/tiny/adapter \
        --data ids.jsonl --seq-len 256 [--expect-loss 3.78 --tolerance 1e-3]

Prints one JSON object: {"loss", "ppl", "tokens", "rope_scaling", "peft_version", ...}.
Exit status 1 when --expect-loss is given and differs by more than --tolerance.
"""
import argparse
import json
import math
import os
import sys

import torch


def windows(length, seq_len, stride):
    if length <= seq_len:
        return [(0, length)]
    return [(s, s + seq_len) for s in range(0, length - seq_len + 1, max(stride, 1))]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model folder (the adapter's base model)")
    p.add_argument("--adapter", required=True, help="PEFT adapter folder written by lemo-train")
    p.add_argument("--data", required=True, help="JSONL with input_ids per line (as lemo-train eval reads)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--expect-loss", type=float, help="lemo-train eval's loss, to compare against")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--merge", action="store_true", help="also check merge_and_unload() gives the same loss")
    args = p.parse_args()

    import peft
    import transformers
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    rope_scaling = None
    info_path = os.path.join(args.adapter, "lemo_training.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        rope_scaling = info.get("rope_scaling")
    if rope_scaling:
        # transformers 5 reads rope_parameters; older versions rope_scaling. Set both.
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", None)
        theta = theta or 10000.0
        params = {"rope_type": rope_scaling["rope_type"], "factor": float(rope_scaling["factor"]), "rope_theta": theta}
        if getattr(config, "rope_parameters", None) is not None:
            config.rope_parameters = params  # transformers >= 5 (rope_scaling aliases it)
        else:
            config.rope_scaling = {"rope_type": rope_scaling["rope_type"], "factor": float(rope_scaling["factor"])}
    dtype = getattr(torch, args.dtype)
    base = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=dtype, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, args.adapter)
    model.to(args.device).eval()

    docs = []
    with open(args.data) as f:
        for line in f:
            if line.strip():
                docs.append(json.loads(line)["input_ids"])

    def score(m):
        loss_sum, count = 0.0, 0
        with torch.no_grad():
            for doc in docs:
                if len(doc) < 2:
                    continue
                for s, e in windows(len(doc), args.seq_len, args.stride):
                    ids = torch.tensor([doc[s:e]], device=args.device)
                    logits = m(input_ids=ids).logits.float()
                    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
                    loss_sum += loss.item()
                    count += e - s - 1
        return loss_sum / count, count

    loss, tokens = score(model)
    report = {
        "loss": loss,
        "ppl": math.exp(loss),
        "tokens": tokens,
        "rope_scaling": rope_scaling,
        "peft_version": peft.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": args.device,
    }
    if args.merge:
        report["merged_loss"] = score(model.merge_and_unload())[0]
    if args.expect_loss is not None:
        report["expected_loss"] = args.expect_loss
        report["abs_diff"] = abs(loss - args.expect_loss)
        report["ok"] = report["abs_diff"] <= args.tolerance
    print(json.dumps(report))
    if args.expect_loss is not None and not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
