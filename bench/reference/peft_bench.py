#!/usr/bin/env python3
"""PyTorch + PEFT reference for `lemo-train bench`: a few LoRA training steps of a random-init model of
a Hugging Face config, per sequence length, printing one JSON line per length (and optionally
writing all of them to --out): median step time, tokens/s, peak memory and memory after the forward
pass (torch.cuda.max_memory_allocated / memory_allocated), the caching allocator's peak reservation
(torch.cuda.max_memory_reserved), or {"oom": true}.

Setup, matched to what DESIGN.md's measurements used: LoRA r=8, alpha=16, dropout 0 on
q_proj/k_proj/v_proj/o_proj; bf16 weights; SDPA attention; batch 1; random token ids; AdamW
(PyTorch defaults, lr 1e-4); optional gradient checkpointing (--checkpointing); optional
Liger-Kernel (--liger: its fused RMSNorm, RoPE, SwiGLU and linear + cross-entropy, patched into the
model classes before the model is built, as axolotl's and LLaMA-Factory's switches do); optional
QLoRA base (--load-in-4bit: every decoder projection a bitsandbytes Linear4bit, NF4 with double
quantization and bf16 compute, as `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)` loads a checkpoint; embeddings and lm_head stay bf16).

    python bench/reference/peft_bench.py --model bench/configs/llama-2-7b.json --seq-lens 4096,8192
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="config.json (or folder) of the architecture")
    p.add_argument("--seq-lens", default="4096,8192")
    p.add_argument("--steps", type=int, default=5, help="measured steps (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--method", default="lora", choices=["lora", "longlora"],
                   help="longlora: also train embeddings and norms (attention stays dense SDPA here)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--liger", action="store_true",
                   help="Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and fused linear cross-entropy")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="bitsandbytes NF4 (double quantization, bf16 compute) for the decoder's projections: QLoRA")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write all results as a JSON array here")
    args = p.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    path = args.model if os.path.isdir(args.model) else os.path.dirname(os.path.abspath(args.model))
    if os.path.isdir(args.model):
        config = AutoConfig.from_pretrained(args.model)
    else:
        with open(args.model) as f:
            raw = json.load(f)
        model_type = raw.pop("model_type")
        config = AutoConfig.for_model(model_type, **raw)
    name = os.path.splitext(os.path.basename(args.model.rstrip("/")))[0]
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    if args.liger:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel
        if config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            sys.exit(f"error: Liger-Kernel has no kernels for model type {config.model_type}")
        _apply_liger_kernel(config.model_type, rope=True, rms_norm=True, swiglu=True,
                            cross_entropy=False, fused_linear_cross_entropy=True)

    torch.manual_seed(0)
    t0 = time.time()
    if args.load_in_4bit:
        model = build_quantized(AutoModelForCausalLM, config, dtype, args.attn, device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)
    model.config.use_cache = False
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if config.model_type != "opt" else ["q_proj", "k_proj", "v_proj", "out_proj"]
    modules_to_save = ["embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"] if args.method == "longlora" else None
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules=targets,
                      modules_to_save=modules_to_save, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"peft_bench: {name} built in {time.time() - t0:.1f}s ({trainable} trainable parameters)", file=sys.stderr)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    results = []
    ran_out = False
    for seq_len in [int(s) for s in args.seq_lens.split(",") if s]:
        result = {"model": name, "method": args.method, "seq_len": seq_len, "checkpointing": args.checkpointing,
                  "backend": f"torch {torch.__version__} {args.dtype} {args.attn}" + (" liger" if args.liger else "")
                  + (" bnb-nf4" if args.load_in_4bit else ""), "oom": False, "error": None,
                  "steps": args.steps, "trainable_params": trainable}
        if ran_out:
            result.update(oom=True, error="skipped: a shorter sequence already ran out of memory")
            print(json.dumps(result), flush=True)
            results.append(result)
            continue
        ids = torch.randint(0, config.vocab_size, (1, seq_len), device=device)
        times, after_forward = [], 0
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            for step in range(args.warmup + args.steps):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(input_ids=ids, labels=ids)
                if cuda and step >= args.warmup:
                    after_forward = max(after_forward, torch.cuda.memory_allocated())
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del out
                if cuda:
                    torch.cuda.synchronize()
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
            median = statistics.median(times)
            result.update(step_time_s_median=median, step_times_s=times, tokens_per_s=seq_len / median)
            if cuda:
                result.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, after_forward_gib=after_forward / 2**30,
                              reserved_peak_gib=torch.cuda.max_memory_reserved() / 2**30,
                              mem_source="torch.cuda.max_memory_allocated")
        except torch.OutOfMemoryError as e:
            ran_out = True
            result.update(oom=True, error=str(e).splitlines()[0])
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


def build_quantized(auto_model, config, dtype, attn, device):
    """The model with every decoder projection a bitsandbytes NF4 Linear4bit (double quantization,
    bf16 compute), as transformers' bitsandbytes loader makes it. Built on the device one decoder
    layer at a time, each layer's projections quantized before the next is made, so the device
    never holds more than one layer in bf16 (a random 8B model made on the host takes minutes)."""
    import copy
    import importlib

    import bitsandbytes as bnb

    layers = config.num_hidden_layers
    shell = copy.deepcopy(config)
    shell.num_hidden_layers = 0
    with torch.device(device):
        model = auto_model.from_config(shell, dtype=dtype, attn_implementation=attn)
    layer_class = getattr(importlib.import_module(type(model).__module__), next(iter(model._no_split_modules)))
    model_config = model.config
    model_config.num_hidden_layers = layers
    for index in range(layers):
        with torch.device(device):
            layer = layer_class(model_config, index).to(dtype)
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                                  compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                                  device="meta")
                    quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                                         compress_statistics=True, quant_type="nf4").to(device)
                    if child.bias is not None:
                        quantized.bias = child.bias
                    setattr(parent, name, quantized)
        model.model.layers.append(layer)
    model.is_loaded_in_4bit = True  # PEFT then wraps the projections in its bitsandbytes LoRA layers
    return model


if __name__ == "__main__":
    main()
