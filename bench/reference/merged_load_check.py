#!/usr/bin/env python3
"""Load a model written by `lemo-train merge` with Hugging Face transformers and score it as
`lemo-train eval` does (see peft_load_check.py for the windows).

The folder is loaded with `AutoModelForCausalLM.from_pretrained` (config.json, safetensors, the
RoPE scaling recorded in the config). With --gguf, the GGUF file written beside it is loaded too,
through transformers' GGUF reader (`gguf_file=`), which dequantizes the tensors and undoes
llama.cpp's q/k row order; its config is the folder's, because transformers does not read
`llama.rope.scaling.*` from GGUF metadata.

    python bench/reference/merged_load_check.py --model merged --data ids.jsonl --seq-len 1024 \
        [--gguf merged/model-q8_0.gguf] [--expect-loss 2.31 --tolerance 1e-4 --gguf-tolerance 1e-2]

Prints one JSON object; exit status 1 when a loss differs from --expect-loss by more than its
tolerance (relative).
"""
import argparse
import json
import math
import os
import sys

import torch

from peft_load_check import windows


def score(model, docs, seq_len, stride):
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            if len(doc) < 2:
                continue
            for s, e in windows(len(doc), seq_len, stride):
                ids = torch.tensor([doc[s:e]])
                logits = model(input_ids=ids).logits.float()
                loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
                loss_sum += loss.item()
                count += e - s - 1
    return loss_sum / count, count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="folder written by lemo-train merge")
    p.add_argument("--gguf", help="GGUF file written by lemo-train merge --gguf")
    p.add_argument("--data", required=True, help="JSONL with input_ids per line (as lemo-train eval reads)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--expect-loss", type=float, help="lemo-train eval --adapter's loss on the base")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--gguf-tolerance", type=float, default=1e-2)
    args = p.parse_args()

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(args.data) as f:
        docs = [json.loads(line)["input_ids"] for line in f if line.strip()]
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    loss, tokens = score(model, docs, args.seq_len, args.stride)
    report = {
        "loss": loss,
        "ppl": math.exp(loss),
        "tokens": tokens,
        "rope_scaling": getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    checks = [("loss", args.tolerance)]
    if args.gguf:
        gguf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(args.gguf)),
            gguf_file=os.path.basename(args.gguf),
            config=config,
            dtype=torch.float32,
            attn_implementation="eager",
        ).eval()
        report["gguf_loss"] = score(gguf, docs, args.seq_len, args.stride)[0]
        checks.append(("gguf_loss", args.gguf_tolerance))
    ok = True
    if args.expect_loss is not None:
        report["expected_loss"] = args.expect_loss
        for key, tolerance in checks:
            difference = abs(report[key] - args.expect_loss) / abs(args.expect_loss)
            report[f"{key}_relative_diff"] = difference
            ok = ok and difference <= tolerance
        report["ok"] = ok
    print(json.dumps(report))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
