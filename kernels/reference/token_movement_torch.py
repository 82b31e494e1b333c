#!/usr/bin/env python3
"""PyTorch reference for `token_movement_bench`: one block of a token-sparse layer in eager
PyTorch, on the same shapes and timed the same way (CUDA events around loops of back-to-back
steps, median of repeats; each step updates the residual stream, and backward the gradient,
that the next one reads).

- naive: `index_select` the kept rows, RMSNorm (Hugging Face Llama's, in float32), zero-pad to
  [S, hidden] with `index_copy`, add to the residual; backward through autograd
  (`torch.autograd.grad` of the step's output with respect to its input);
- index_add: the same gather and RMSNorm, then `index_add` into the residual (PyTorch's own
  scatter-add, out of place under autograd).

Kept rows: half of the 64-row blocks (the first and the last always), fixed seed.
Writes one JSON report (--out).
"""

import argparse
import json
import statistics

import torch

BLOCK = 64
EPS = 1e-5


def kept_rows(seq, keep, generator):
    blocks = (seq + BLOCK - 1) // BLOCK
    kept_blocks = max(min(2, blocks), min(blocks, round(blocks * keep)))
    middle = torch.randperm(max(blocks - 2, 0), generator=generator)[: max(kept_blocks - 2, 0)] + 1
    chosen = torch.cat([torch.tensor([0, blocks - 1]), middle]).unique().sort().values
    rows = (chosen[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).flatten()
    return rows[rows < seq].cuda()


def rms_norm(x, weight):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x.to(dtype)


def naive(x, rows, weight):
    y = rms_norm(x.index_select(0, rows), weight)
    return x + torch.zeros_like(x).index_copy(0, rows, y)


def index_add(x, rows, weight):
    y = rms_norm(x.index_select(0, rows), weight)
    return x.index_add(0, rows, y)


def time_steps(step, state, repeats):
    """Median seconds of one step: loops of steps sized to about 20 ms, after a warm-up."""
    state = step(state)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    state = step(state)
    end.record()
    torch.cuda.synchronize()
    calls = max(2, min(50, int(0.02 / max(start.elapsed_time(end) / 1e3, 1e-6)) + 1))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            state = step(state)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", default="4096,8192,16384,32768,65536")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    timings = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        rows = kept_rows(seq, args.keep, generator)
        weight = (torch.randn(args.hidden, device="cuda") * 0.1 + 1.0).bfloat16()
        x0 = torch.randn(seq, args.hidden, device="cuda", dtype=torch.bfloat16)
        grad0 = torch.randn_like(x0)
        entry = {"seq": seq, "kept": int(rows.numel())}
        for name, block in [("naive", naive), ("index_add", index_add)]:

            def forward(state):
                x, grad = state
                with torch.no_grad():
                    return block(x, rows, weight), grad

            def forward_backward(state):
                x, grad = state
                x = x.detach().requires_grad_()
                out = block(x, rows, weight)
                (grad,) = torch.autograd.grad(out, x, grad)
                return out.detach(), grad

            for pass_name, step in [("forward", forward), ("forward_backward", forward_backward)]:
                seconds = time_steps(step, (x0.clone(), grad0.clone()), args.repeats)
                timings.append({**entry, "pass": pass_name, f"torch_{name}_ms": seconds * 1e3})
                print(f"{pass_name} S={seq} torch_{name}: {seconds * 1e3:.3f} ms", flush=True)

    # One entry per (seq, pass) with both variants.
    merged = {}
    for t in timings:
        merged.setdefault((t["seq"], t["pass"]), {}).update(t)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch_version": torch.__version__,
        "dtype": "bf16",
        "hidden": args.hidden,
        "keep": args.keep,
        "timings": list(merged.values()),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
