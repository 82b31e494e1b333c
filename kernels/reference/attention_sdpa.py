#!/usr/bin/env python3
"""PyTorch reference for lemo-kernels' attention benchmark.

1. Timing: causal bf16 `scaled_dot_product_attention` on q `[1, heads, S, head_dim]` and k/v
   `[1, kv_heads, S, head_dim]` (`enable_gqa=True` where kv_heads < heads) for each S and each
   kv_heads, forward and backward, under each backend: flash, cuDNN, efficient (each forced with
   `sdpa_kernel`) and the default (no context; the backend PyTorch's selector picks for that call
   is recorded as `picked`). A backend that refuses a shape is recorded as unsupported with its
   reason. CUDA-event timed (warm-up, median), FLOPs counted like the Rust harness (forward
   4*B*H*S^2*D/2 with H the query heads, backward 2.5x that).
2. Parity (--parity-dir): small bf16 cases (GQA, sliding window, lengths that are not a multiple
   of any tile). Writes the bf16 inputs, the float32 reference output and gradients (materialized
   masked attention on float32 copies of the same bf16 inputs) and SDPA's own bf16 error
   against that reference, for `attention_bench --parity-dir` to compare with.
   Files: `<case>_{q,k,v,do}.bf16` (raw little-endian), `<case>_{out,dq,dk,dv}.f32`,
   `manifest.json`.
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import warnings

import torch
import torch.nn.functional as F

PARITY_CASES = [
    # name, batch, q_heads, kv_heads, seq, head_dim, window, S2 group, queries (the last
    # q_len positions; None: every position)
    ("causal_h128", 1, 8, 8, 1000, 128, None, None, None),
    ("causal_h128_s1024", 1, 8, 8, 1024, 128, None, None, None),
    ("gqa_batch2_h64", 2, 8, 2, 777, 64, None, None, None),
    ("gqa_batch2_h64_s512", 2, 8, 2, 512, 64, None, None, None),
    ("window_gqa_h128", 1, 8, 4, 1200, 128, 256, None, None),
    ("s2_gqa_h128", 1, 8, 4, 1100, 128, None, 256, None),
    # Groups of multiples of 128 (the shifted half's first and last 128): cuDNN runs them as
    # causal attention over the groups, folded into the batch by strides.
    ("s2_folded_gqa_h128", 1, 8, 4, 1024, 128, None, 256, None),
    ("s2_folded_short_last_h128", 2, 8, 8, 1152, 128, None, 256, None),
    ("s2_folded_gqa_batch2_h64", 2, 8, 2, 1536, 64, None, 512, None),
    # Queries that end a longer sequence (a rank's chunk of a split sequence, decoding with a
    # cache): causal attention aligned at the bottom right.
    ("causal_last_queries_gqa_h128", 2, 8, 2, 1536, 128, None, None, 512),
    ("causal_last_queries_h64_ragged", 1, 4, 4, 1000, 64, None, None, 300),
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


def query_mask(q, k, window, group):
    """`hidden_mask` over `k`'s positions, for queries that are the last of them."""
    mask = hidden_mask(k.shape[2], q.shape[1], window, group, q.device)
    return mask[:, k.shape[2] - q.shape[2]:, :]


def reference_attention(q, k, v, window, group):
    """Materialized float32 attention with K/V heads repeated for GQA."""
    heads = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(heads, dim=1)
    v = v.repeat_interleave(heads, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    mask = query_mask(q, k, window, group)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa(q, k, v, window, group):
    heads = q.shape[1] // k.shape[1]
    if heads > 1:
        k = k.repeat_interleave(heads, dim=1)
        v = v.repeat_interleave(heads, dim=1)
    if window is None and group is None and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # `is_causal` aligns the mask at the top left: fewer queries need it spelled out.
    allowed = ~query_mask(q, k, window, group)
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
    for name, batch, q_heads, kv_heads, seq, head_dim, window, group, q_len in PARITY_CASES:
        q_len = q_len or seq

        def randn(heads, rows):
            return torch.randn(
                batch, heads, rows, head_dim, device="cuda", generator=generator
            ).to(torch.bfloat16)

        q, grad_out = randn(q_heads, q_len), randn(q_heads, q_len)
        k, v = randn(kv_heads, seq), randn(kv_heads, seq)
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
                "q_len": q_len,
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


BACKENDS = ("flash", "cudnn", "efficient", "default")
# SDPBackend member names as the timing entries name them.
BACKEND_NAMES = {
    "FLASH_ATTENTION": "flash",
    "CUDNN_ATTENTION": "cudnn",
    "EFFICIENT_ATTENTION": "efficient",
    "MATH": "math",
}


def backend_context(backend):
    """`sdpa_kernel` forcing `backend`; the default runs outside any context."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return contextlib.nullcontext()
    forced = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    return sdpa_kernel(forced[backend])


def default_choice(q, k, v, gqa):
    """The backend PyTorch's selector picks for this call outside any `sdpa_kernel` context (the
    choice the default dispatches on), or None where this build does not tell."""
    from torch.nn.attention import SDPBackend

    names = {int(value): name for name, value in SDPBackend.__members__.items()}
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, True, **gqa))
    except Exception:
        return None
    name = names.get(choice)
    return BACKEND_NAMES.get(name, name.lower() if name else None)


def refusal(error, caught):
    """One line: the error, then the reasons PyTorch gave as warnings for skipping a backend (the
    error itself only says that no kernel was available)."""
    reasons = []
    for warning in caught:
        text = re.sub(r"\(Triggered internally at [^)]*\)\.?", "", str(warning.message))
        text = " ".join(text.split())
        # Headers ("... not used because:") and disabled backends say nothing about the shape.
        if text and not text.endswith(":") and "runtime disabled" not in text:
            reasons.append(text)
    lines = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return f"{line} ({'; '.join(dict.fromkeys(reasons))})" if reasons else line


def time_backend(backend, q, k, v, grad_out, gqa, iterations):
    """Median forward and backward ms of SDPA under `backend`, per kernel name, each `(ms, None)`
    or, where the backend raises, `(None, reason)`; a refused forward refuses the backward too."""

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    times = {}
    with backend_context(backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            times["attention_forward"] = (median_ms(attend, iterations), None)
            out = attend()
        except Exception as error:
            reason = refusal(error, caught)
            return {"attention_forward": (None, reason), "attention_backward": (None, reason)}
        try:
            backward = median_ms(
                lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
                iterations,
            )
            times["attention_backward"] = (backward, None)
        except Exception as error:
            times["attention_backward"] = (None, refusal(error, caught))
    return times


def throughput(seqs, heads, kv_heads_list, head_dim, iterations):
    results = []
    for seq in seqs:
        for kv_heads in kv_heads_list:
            # The flag only where the heads differ: the MHA shape stays a plain multi-head call.
            gqa = {"enable_gqa": True} if kv_heads != heads else {}
            q, k, v = (
                torch.randn(
                    (1, h, seq, head_dim),
                    device="cuda",
                    dtype=torch.bfloat16,
                    requires_grad=True,
                )
                for h in (heads, kv_heads, kv_heads)
            )
            grad_out = torch.randn((1, heads, seq, head_dim), device="cuda", dtype=torch.bfloat16)
            forward_flops = 4 * heads * head_dim * seq**2 / 2
            flops = {"attention_forward": forward_flops, "attention_backward": 2.5 * forward_flops}
            picked = default_choice(q, k, v, gqa)
            for backend in BACKENDS:
                times = time_backend(backend, q, k, v, grad_out, gqa, iterations)
                for kernel, (ms, error) in times.items():
                    tflops = flops[kernel] / (ms * 1e-3) / 1e12 if ms is not None else None
                    label = f"sdpa {backend:>9} {kernel} S={seq} kv={kv_heads}"
                    if ms is None:
                        print(f"{label}: unsupported: {error}")
                    else:
                        print(f"{label}: {ms:.3f} ms, {tflops:.1f} TFLOP/s")
                    entry = {
                        "kernel": kernel,
                        "backend": backend,
                        "batch": 1,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "seq": seq,
                        "head_dim": head_dim,
                        "dtype": "bf16",
                        "causal": True,
                        "median_ms": ms,
                        "tflops": tflops,
                        "supported": ms is not None,
                    }
                    if error is not None:
                        entry["error"] = error
                    if backend == "default":
                        entry["picked"] = picked
                    results.append(entry)
                torch.cuda.empty_cache()
            del q, k, v, grad_out
            torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,16384,65536")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument(
        "--kv-heads", default="32,8", help="comma-separated key/value head counts, one shape each"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--parity-dir")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    kv_heads = [int(h) for h in args.kv_heads.split(",")]
    if any(args.heads % h for h in kv_heads):
        parser.error("--kv-heads: each must divide --heads")

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.parity_dir:
        write_parity(args.parity_dir, seed)
    timings = throughput(
        [int(s) for s in args.seqs.split(",") if s],  # --seqs '': parity files alone
        args.heads, kv_heads, args.head_dim, args.iterations,
    )
    report = {
        "implementation": f"torch {torch.__version__} scaled_dot_product_attention "
        f"({', '.join(BACKENDS)})",
        "device": torch.cuda.get_device_name(),
        "timings": timings,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
