#!/usr/bin/env python3
"""Summary of a CubeCL memory log, to see where a run's device memory goes in the pools.

Run lemo-train in a folder holding a `cubecl.toml` with

    [memory.logger]
    level = "full"
    file = "mem.log"

then `python3 bench/pool_log.py mem.log`: the dynamic reservations by size (those of 256 MB or
more listed) and, at the moment the pools held the most, each pool's pages, reserved and
in-use bytes (the persistent pool's slices by size).

`python3 bench/pool_log.py --timeline mem.log` prints instead, for the main GPU pools, every new
page (the request that made it, then reserved / in-use bytes of all pools and of each) and every
explicit cleanup, in order: where in the step the pools grow (in-use rising: the forward pass).
"""
import re, sys, collections
unit = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
def size(text):
    m = re.match(r"([\d.]+) (\w+)", text.strip()); return float(m.group(1)) * unit[m.group(2)]

def timeline(path):
    request = 0; dump = None; cleanups = 0; events = 0
    def show(dump):
        pools = []; pool = None; in_use = 0
        for l in dump:
            if l.startswith("## Persistent"): pool = "persistent"
            m = re.match(r"\s*- Sliced Pool page_size=([\d.]+ \w+)", l)
            if m: pool = m.group(1).replace(" ", "")
            if l.startswith("## Summary"): pool = "all"
            m = re.search(r"Bytes in use: (.*)", l)
            if m: in_use = size(m.group(1))
            m = re.search(r"Total bytes reserved: (.*)", l)
            if m and pool and size(m.group(1)) > 0:
                pools.append(f"{pool} {size(m.group(1)) / 1e9:.1f}/{in_use / 1e9:.1f}")
        print(f"{events:>7} request {request / 1e6:9.1f} MB: GB reserved/in use: {', '.join(reversed(pools))}")
    for line in open(path, errors="replace"):
        if line.startswith("["):
            if dump is not None: show(dump); dump = None
            if not line.startswith("[Main GPU Memory]"): continue
            events += 1
            m = re.search(r"Reserved memory ([\d.]+ \w+) using dynamic pool", line)
            if m: request = size(m.group(1))
            m = re.search(r"Reserved memory (\d+) using persistent memory", line)
            if m: request = float(m.group(1))
            if "Allocated a new memory page" in line: dump = []
            if "Manual memory cleanup" in line: cleanups += 1; print(f"{events:>7} cleanup {cleanups}")
        elif dump is not None:
            dump.append(line)
    if dump is not None: show(dump)

if sys.argv[1] == "--timeline":
    timeline(sys.argv[2]); sys.exit()
big = collections.Counter(); small = 0; pages = 0
best = (0, []); dump = None
def close(dump):
    global best
    totals = [size(m) for l in dump for m in re.findall(r"Total bytes reserved: (.*)", l)]
    total = totals[-1] if totals else 0
    if total > best[0]: best = (total, dump)
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Reserved memory ([\d.]+ \w+) using dynamic pool", line)
    if m:
        s = size(m.group(1))
        if s >= 256e6: big[round(s / 1e6, 1)] += 1
        else: small += 1
        if dump is not None: close(dump); dump = None
        continue
    if "Allocated a new memory page" in line:
        pages += 1
        if dump is not None: close(dump)
        dump = []; continue
    if dump is not None:
        dump.append(line.rstrip())
if dump is not None: close(dump)
print(f"dynamic reservations under 256 MB: {small}; new pages: {pages}")
print("dynamic reservations of 256 MB or more (MB: count):")
for s, n in sorted(big.items()): print(f"  {s:>10} MB: {n}")
print(f"pools at their largest ({best[0] / 1e9:.2f} GB reserved in all):")
pool = None; npages = 0
for l in best[1]:
    if l.startswith("## Persistent"): pool = "persistent"; npages = 0
    if l.startswith("## Summary"): pool = "all pools"; npages = 0
    m = re.match(r"\s*- (Sliced|Exclusive) Pool (.*)", l)
    if m: pool = m.group(2); npages = 0
    if re.match(r"\s*- Page ", l): npages += 1
    if "Bytes in use" in l and pool: inuse = l.split(":")[1].strip()
    if "Total bytes reserved" in l and pool:
        print(f"  {pool}: {npages} pages, reserved {l.split(':')[1].strip()}, in use {inuse}")
    if l.startswith("  - Slices") and pool == "persistent": print("   ", l.strip())
