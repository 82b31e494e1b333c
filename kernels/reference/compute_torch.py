#!/usr/bin/env python3
"""PyTorch reference for lemo-kernels' compute benchmark (`compute_bench`).

Times, on the same shapes and the same way as the Rust harness (a loop of back-to-back calls
between two synchronizations, after warm-up, median of repeats; CUDA events):
1. bf16 GEMMs of a linear layer y = x W^T (W [N, K]): forward `x @ W.t()`, input gradient
   `dy @ W`, weight gradient `dy.t() @ x` (cuBLAS through torch.matmul);
2. the device copy bandwidth (`clone`, bytes read + written) and eager PyTorch versions of the
   fused kernels (RMSNorm as in HF Llama, rotate-half RoPE, SwiGLU, softmax cross-entropy rows);
3. the plain loss (F.linear + float + F.cross_entropy, forward + backward) with its peak memory
   (`max_memory_allocated` growth) and time.
Writes one JSON report (--out).
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

PROJECTIONS = [
    ("llama2_7b", "qkvo", 4096, 4096),
    ("llama2_7b", "gate_up", 4096, 11008),
    ("llama2_7b", "down", 11008, 4096),
    ("llama2_7b", "lm_head", 4096, 32000),
    ("llama3_8b", "kv", 4096, 1024),
    ("llama3_8b", "gate_up", 4096, 14336),
    ("llama3_8b", "down", 14336, 4096),
    ("llama3_8b", "lm_head", 4096, 128256),
]


def time_calls(fn, calls, repeats):
    """Median seconds of one call, from `repeats` loops of `calls` calls after one warm-up loop."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def gemm_timings(tokens, repeats):
    results = []
    for m in tokens:
        for model, projection, k, n in PROJECTIONS:
            if projection == "lm_head" and m > 16384:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            forms = {
                "fwd": lambda: x @ w.t(),
                "dgrad": lambda: dy @ w,
                "wgrad": lambda: dy.t() @ x,
            }
            flops = 2.0 * m * k * n
            calls = max(2, min(50, int(-(-2e12 // flops))))
            for form, fn in forms.items():
                seconds = time_calls(fn, calls, repeats)
                tflops = flops / seconds / 1e12
                print(f"torch gemm {model} {projection} {form} M={m}: {seconds*1e3:.3f} ms, {tflops:.1f} TFLOP/s")
                results.append({
                    "kernel": f"gemm_{form}", "model": model, "projection": projection,
                    "m": m, "k": k, "n": n, "dtype": "bf16",
                    "median_ms": seconds * 1e3, "tflops": tflops,
                })
            del x, w, dy
    return results


def rms_norm(x, weight, eps=1e-5):
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fused_timings(repeats):
    rows, hidden = 16384, 4096
    numel = rows * hidden
    results = []

    def record(kernel, shape, nbytes, seconds):
        gbps = nbytes / seconds / 1e9
        print(f"torch {kernel} {shape}: {seconds*1e3:.3f} ms, {gbps:.0f} GB/s")
        results.append({"kernel": kernel, "shape": shape, "dtype": "bf16", "bytes": nbytes,
                        "median_ms": seconds * 1e3, "gbps": gbps})

    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(2 ** 29, device="cuda", dtype=torch.bfloat16)
    record("copy", [rows, hidden], 4.0 * numel, time_calls(lambda: x.clone(), 20, repeats))
    record("copy_1gib", [2 ** 29], 4.0 * 2 ** 29, time_calls(lambda: big.clone(), 10, repeats))
    del big
    w = torch.randn(hidden, device="cuda", dtype=torch.float32).mul(0.1).add(1).to(torch.bfloat16)
    record("rms_norm_forward", [rows, hidden], 4.0 * numel, time_calls(lambda: rms_norm(x, w), 20, repeats))
    if hasattr(F, "rms_norm"):
        record("rms_norm_forward_fused_torch", [rows, hidden], 4.0 * numel,
               time_calls(lambda: F.rms_norm(x, (hidden,), w, 1e-5), 20, repeats))
    xr = x.detach().requires_grad_(True)
    out = rms_norm(xr, w)
    record("rms_norm_backward", [rows, hidden], 6.0 * numel,
           time_calls(lambda: torch.autograd.grad(out, xr, g, retain_graph=True), 20, repeats))

    heads, head_dim = 32, 128
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    positions = torch.arange(rows, device="cuda")
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    q = torch.randn(1, rows, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    record("rope_forward", [1, heads, rows, head_dim], 4.0 * numel,
           time_calls(lambda: q * cos + rotate_half(q) * sin, 20, repeats))

    record("swiglu_forward", [rows, hidden], 6.0 * numel, time_calls(lambda: F.silu(x) * g, 20, repeats))
    gate = x.detach().requires_grad_(True)
    up = g.detach().requires_grad_(True)
    out = F.silu(gate) * up
    record("swiglu_backward", [rows, hidden], 10.0 * numel,
           time_calls(lambda: torch.autograd.grad(out, (gate, up), x, retain_graph=True), 20, repeats))

    chunk, vocab = 2048, 128256
    logits = (torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_(True)
    targets = (torch.arange(chunk, device="cuda") * 61) % vocab

    def ce_rows():
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        return torch.autograd.grad(loss, logits)

    record("cross_entropy_rows", [chunk, vocab], 4.0 * chunk * vocab, time_calls(ce_rows, 10, repeats))
    return results


def plain_loss(rows, hidden, vocab):
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.arange(rows, device="cuda") * 7919 % vocab
    targets[7::50] = -100

    def step():
        hr = h.detach().requires_grad_(True)
        loss = F.cross_entropy(F.linear(hr, w).float(), targets, reduction="sum", ignore_index=-100)
        loss.backward()
        return hr.grad

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    seconds = start.elapsed_time(end) / 1e3
    print(f"torch plain loss S={rows} V={vocab}: peak {peak / 2**30:.2f} GiB, {seconds:.3f} s")
    return {"kernel": "plain_cross_entropy_torch", "rows": rows, "hidden": hidden, "vocab": vocab,
            "dtype": "bf16", "peak_bytes": peak, "seconds_forward_backward": seconds,
            "memory_method": "torch.cuda.max_memory_allocated() growth over one forward+backward"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens = [4096] if args.quick else [4096, 16384, 65536]
    timings = gemm_timings(tokens, args.repeats)
    timings += fused_timings(args.repeats)
    timings.append(plain_loss(4096 if args.quick else 16384, 4096, 128256))
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cublas": "via torch.matmul",
        "implementation": "PyTorch eager (cuBLAS GEMMs, eager element-wise ops)",
        "timings": timings,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
