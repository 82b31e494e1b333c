#!/usr/bin/env python3
"""PyTorch reference for lemo-kernels' attention benchmark.

1. Timing: causal bf16 `scaled_dot_product_attention` (flash backend) on `[1, heads, S, head_dim]`
   for each S, forward and backward, CUDA-event timed (warm-up, median), FLOPs counted like
   the Rust harness (forward 4*B*H*S^2*D/2, backward 2.5x that).
2. Parity (--parity-dir): small bf16 cases (GQA, sliding window, lengths that are not a multiple
   of any tile). Writes the bf16 inputs, the float32 reference output and gradients (materialized
   masked attention on float32 copies of the same bf16 inputs) and SDPA's own bf16 error
   against that reference, for `attention_bench --parity-dir` to compare with.
   Files: `<case>_{q,k,v,do}.bf16` (raw little-endian), `<case>_{out,dq,dk,dv}.f32`,
   `manifest.json`.
"""

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

PARITY_CASES = [
    # name, batch, q_heads, kv_heads, seq, head_dim, window, S2 group
    ("causal_h128", 1, 8, 8, 1000, 128, None, None),
    ("gqa_batch2_h64", 2, 8, 2, 777, 64, None, None),
    ("window_gqa_h128", 1, 8, 4, 1200, 128, 256, None),
    ("s2_gqa_h128", 1, 8, 4, 1100, 128, None, 256),
]


def hidden_mask(seq, heads, window, group, device):
    """`[heads, seq, seq]` True where a query (row) must not see a key (column): causal, the
    sliding window, and S2 groups (heads in the second half shifted by half a group, without
    wrapping around, as lemo-kernels defines them)."""
    pos = torch.arange(seq, device=device)
    distance = pos[:, None] - pos[None, :]
    hidden = (distance < 0).expand(heads, seq, seq).clone()
    if window is not None:
        hidden |= distance >= window
    if group is not None:
        for head in range(heads):
            shift = group // 2 if head >= heads // 2 else 0
            bucket = (pos + shift) // group
            hidden[head] |= bucket[:, None] != bucket[None, :]
    return hidden


def reference_attention(q, k, v, window, group):
    """Materialized float32 attention with K/V heads repeated for GQA."""
    heads = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(heads, dim=1)
    v = v.repeat_interleave(heads, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    mask = hidden_mask(q.shape[2], q.shape[1], window, group, q.device)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa(q, k, v, window, group):
    heads = q.shape[1] // k.shape[1]
    if heads > 1:
        k = k.repeat_interleave(heads, dim=1)
        v = v.repeat_interleave(heads, dim=1)
    if window is None and group is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    allowed = ~hidden_mask(q.shape[2], q.shape[1], window, group, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def relative_error(actual, expected):
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


def forward_backward(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad.detach() for t in leaves]


def write_parity(directory, seed):
    os.makedirs(directory, exist_ok=True)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cases = []
    for name, batch, q_heads, kv_heads, seq, head_dim, window, group in PARITY_CASES:
        def randn(heads):
            return torch.randn(
                batch, heads, seq, head_dim, device="cuda", generator=generator
            ).to(torch.bfloat16)

        q, k, v, grad_out = randn(q_heads), randn(kv_heads), randn(kv_heads), randn(q_heads)
        expected = forward_backward(
            lambda q, k, v: reference_attention(q, k, v, window, group),
            [q.float(), k.float(), v.float()],
            grad_out.float(),
        )
        theirs = forward_backward(
            lambda q, k, v: sdpa(q, k, v, window, group), [q, k, v], grad_out
        )
        tensors = ("out", "dq", "dk", "dv")
        for tensor_name, tensor in zip(("q", "k", "v", "do"), (q, k, v, grad_out)):
            path = os.path.join(directory, f"{name}_{tensor_name}.bf16")
            tensor.contiguous().view(torch.int16).cpu().numpy().tofile(path)
        for tensor_name, tensor in zip(tensors, expected):
            path = os.path.join(directory, f"{name}_{tensor_name}.f32")
            tensor.float().contiguous().cpu().numpy().tofile(path)
        sdpa_error = {t: relative_error(a, e) for t, a, e in zip(tensors, theirs, expected)}
        print(f"parity {name}: sdpa error {sdpa_error}")
        cases.append(
            {
                "name": name,
                "batch": batch,
                "q_heads": q_heads,
                "kv_heads": kv_heads,
                "seq": seq,
                "head_dim": head_dim,
                "window": window,
                "group": group,
                "sdpa_error": sdpa_error,
            }
        )
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump({"seed": seed, "cases": cases}, f, indent=2)


def median_ms(run, iterations):
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iterations):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def throughput(seqs, heads, head_dim, iterations):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = []
    for seq in seqs:
        shape = (1, heads, seq, head_dim)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        forward_flops = 4 * heads * head_dim * seq**2 / 2
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            forward = median_ms(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iterations
            )
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            backward = median_ms(
                lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
                iterations,
            )
        for kernel, ms, flops in (
            ("attention_forward", forward, forward_flops),
            ("attention_backward", backward, 2.5 * forward_flops),
        ):
            tflops = flops / (ms * 1e-3) / 1e12
            print(f"sdpa {kernel} S={seq}: {ms:.3f} ms, {tflops:.1f} TFLOP/s")
            results.append(
                {
                    "kernel": kernel,
                    "batch": 1,
                    "heads": heads,
                    "seq": seq,
                    "head_dim": head_dim,
                    "dtype": "bf16",
                    "causal": True,
                    "median_ms": ms,
                    "tflops": tflops,
                }
            )
        del q, k, v, grad_out, out
        torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,16384,65536")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--parity-dir")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.parity_dir:
        write_parity(args.parity_dir, seed)
    timings = throughput(
        [int(s) for s in args.seqs.split(",")], args.heads, args.head_dim, args.iterations
    )
    report = {
        "implementation": f"torch {torch.__version__} scaled_dot_product_attention (flash)",
        "device": torch.cuda.get_device_name(),
        "timings": timings,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
