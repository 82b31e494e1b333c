#!/usr/bin/env python3
"""Merge attention_bench's reports and attention_sdpa.py's into kernels/results/h200.json: per
kernel, variant and shape (query and key/value heads), our TFLOP/s, SDPA's per backend (flash,
cuDNN, efficient and the default, with the backend the default picked), our ratio to the default
and to the fastest backend, the targets, the commit and the command. Entries of other kernels
already in the file (the compute kernels) are kept. Reports without `kv_heads` or `backend`
(older runs) count as multi-head attention (kv_heads = heads), SDPA timed on the flash backend."""

import argparse
import json
import os

# The fastest backend is the best of these; the default is reported on its own.
BACKENDS = ("flash", "cudnn", "efficient")
# Targets of the dense-mode issue, forward and backward, at 4K, 16K and 64K: at least the
# default's TFLOP/s and at least 0.9x the fastest backend's.
TARGETS = {"vs_default": 1.0, "vs_fastest": 0.9}
TARGET_SEQS = (4096, 16384, 65536)


def key(entry):
    return (
        entry["kernel"],
        entry["batch"],
        entry["heads"],
        entry.get("kv_heads", entry["heads"]),
        entry["seq"],
        entry["head_dim"],
    )


def ratio(ours, theirs):
    return ours["tflops"] / theirs["tflops"] if theirs else None


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
    # Per shape: backend -> SDPA's entry.
    theirs = {}
    for entry in reference["timings"]:
        theirs.setdefault(key(entry), {})[entry.get("backend", "flash")] = entry

    results = []
    for entry in ours["timings"]:
        sdpa = theirs.get(key(entry), {})
        timed = {b: e for b, e in sdpa.items() if e.get("supported", True)}
        fastest = max(
            (b for b in BACKENDS if b in timed), key=lambda b: timed[b]["tflops"], default=None
        )
        vs_default = ratio(entry, timed.get("default"))
        vs_fastest = ratio(entry, timed.get(fastest))
        on_target = entry["seq"] in TARGET_SEQS
        meets = None
        if on_target and vs_default is not None and vs_fastest is not None:
            meets = vs_default >= TARGETS["vs_default"] and vs_fastest >= TARGETS["vs_fastest"]
        results.append(
            {
                "kernel": entry["kernel"],
                "variant": entry.get("variant"),
                "shape": {
                    "batch": entry["batch"],
                    "heads": entry["heads"],
                    "kv_heads": entry.get("kv_heads", entry["heads"]),
                    "seq": entry["seq"],
                    "head_dim": entry["head_dim"],
                },
                "dtype": entry["dtype"],
                "causal": entry["causal"],
                "ours": {k: entry[k] for k in ("median_ms", "tflops", "device_bytes_in_use")},
                "sdpa": {
                    b: {k: e[k] for k in ("median_ms", "tflops")}
                    if b in timed
                    else {"unsupported": e.get("error")}
                    for b, e in sdpa.items()
                },
                "sdpa_default_picked": sdpa.get("default", {}).get("picked"),
                "sdpa_fastest": fastest,
                "ratio_vs_default": vs_default,
                "ratio_vs_fastest": vs_fastest,
                "target_ratio": TARGETS if on_target else None,
                "meets_target": meets,
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

    def number(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    for r in results:
        backends = " ".join(
            f"{b} {'unsupported' if 'unsupported' in s else number(s['tflops'], 1)}"
            for b, s in r["sdpa"].items()
        )
        picked = r["sdpa_default_picked"]
        picked = f" (default picked {picked})" if picked else ""
        flag = {True: "ok", False: "MISS", None: ""}[r["meets_target"]]
        print(
            f"{r['kernel']:>18} {r['variant'] or '':>11} kv={r['shape']['kv_heads']:>2} "
            f"S={r['shape']['seq']:>6}: ours {r['ours']['tflops']:6.1f} TFLOP/s; "
            f"sdpa {backends or 'not timed'}"
            f"{picked}; "
            f"x default {number(r['ratio_vs_default'], 3)}, "
            f"x fastest ({r['sdpa_fastest'] or '-'}) {number(r['ratio_vs_fastest'], 3)} {flag}"
        )


if __name__ == "__main__":
    main()
