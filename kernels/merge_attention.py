#!/usr/bin/env python3
"""Merge attention_bench's reports and attention_sdpa.py's into kernels/results/h200.json: per
kernel, variant and shape, our TFLOP/s, SDPA's, their ratio, the target, the commit and the
command. Entries of other kernels already in the file (the compute kernels) are kept."""

import argparse
import json
import os


def key(entry):
    return (entry["kernel"], entry["batch"], entry["heads"], entry["seq"], entry["head_dim"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", required=True, nargs="+", help="one report per variant run")
    parser.add_argument("--reference", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    ours = {"implementation": None, "parity": [], "timings": []}
    for path in args.ours:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            print(f"skipping {path}: {error}")
            continue
        ours["implementation"] = report["implementation"]
        ours["parity"] += report.get("parity", [])
        ours["timings"] += report["timings"]
    with open(args.reference) as f:
        reference = json.load(f)
    theirs = {key(entry): entry for entry in reference["timings"]}
    # Targets from the flash-attention issue: forward >= 0.6x, backward >= 0.5x of SDPA.
    targets = {"attention_forward": 0.6, "attention_backward": 0.5}

    results = []
    for entry in ours["timings"]:
        match = theirs.get(key(entry))
        ratio = entry["tflops"] / match["tflops"] if match else None
        results.append(
            {
                "kernel": entry["kernel"],
                "variant": entry.get("variant"),
                "shape": {k: entry[k] for k in ("batch", "heads", "seq", "head_dim")},
                "dtype": entry["dtype"],
                "causal": entry["causal"],
                "ours": {k: entry[k] for k in ("median_ms", "tflops", "device_bytes_in_use")},
                "reference": {k: match[k] for k in ("median_ms", "tflops")} if match else None,
                "ratio": ratio,
                "target_ratio": targets.get(entry["kernel"]),
                "meets_target": ratio is not None and ratio >= targets.get(entry["kernel"], 0),
                "commit": args.commit,
                "command": args.command,
            }
        )
    merged = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            merged = json.load(f)
    others = [r for r in merged.get("results", []) if not r["kernel"].startswith("attention_")]
    merged["results"] = others + results
    merged["attention_device"] = reference.get("device")
    merged["attention_ours"] = ours["implementation"]
    merged["attention_reference"] = reference["implementation"]
    merged["attention_parity"] = ours["parity"]
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=2)
    for r in results:
        print(
            f"{r['kernel']:>20} {r['variant'] or '':>11} S={r['shape']['seq']:>6}: ours {r['ours']['tflops']:7.1f} "
            f"TFLOP/s, sdpa {r['reference']['tflops'] if r['reference'] else float('nan'):7.1f}, "
            f"ratio {r['ratio'] if r['ratio'] is not None else float('nan'):.3f}"
        )


if __name__ == "__main__":
    main()
