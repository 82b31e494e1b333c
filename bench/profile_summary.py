"""Per-kernel GPU time of one training step from CubeCL's profiling log.

`lemo-train bench` run with a `cubecl.toml` that sets `[profiling.logger] level = "basic"` logs
every CubeCL kernel with its device time (each launch is timed alone, so kernels of a few
microseconds read a little long) and prints a summary table at every device synchronization.
The last table of the log is the last measured step; this script reads it and prints the kernels
by total time, or writes them as JSON. cuBLASLt GEMMs and cuDNN attention are not CubeCL kernels
and do not appear: the step time minus this total is theirs (plus launch gaps).

    python3 bench/profile_summary.py prof.log [--json out.json] [--top 25]
"""
import argparse
import json
import re

UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
DURATION = re.compile(r"^([0-9.]+)(ns|µs|us|ms|s)$")


def last_table(path):
    """Rows `(kernel, seconds, launches)` of the log's last summary table."""
    tables, rows = [], None
    for line in open(path, encoding="utf-8", errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "Name":
            rows = []
        elif rows is not None and cells and cells[0] == "Total":
            tables.append(rows)
            rows = None
        elif rows is not None and len(cells) >= 4:
            match = DURATION.match(cells[-3])
            if match:
                name = " | ".join(c for c in cells[:-3] if c != "CudaRuntime")
                rows.append((name, float(match.group(1)) * UNITS[match.group(2)], int(cells[-2])))
    if not tables:
        raise SystemExit(f"{path}: no profiling summary table (was the profiling logger on?)")
    return tables[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--json")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = sorted(last_table(args.log), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    launches = sum(r[2] for r in rows)
    if args.json:
        json.dump({"total_ms": total * 1e3, "launches": launches,
                   "kernels": [{"kernel": n, "ms": s * 1e3, "launches": c} for n, s, c in rows]},
                  open(args.json, "w"), indent=1)
    print(f"CubeCL kernels in the step: {total * 1e3:.1f} ms over {launches} launches")
    for name, seconds, count in rows[: args.top]:
        print(f"{seconds * 1e3:9.2f} ms {count:6d}x  {name[:110]}")


if __name__ == "__main__":
    main()
