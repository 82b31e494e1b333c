"""Readers of the files the GPU bench scripts leave in their work folder (imported by their merge
steps, which run from the repository root with bench/ on the path)."""
import json


def first_result(path):
    """The first row of a bench JSON array (`--out`), or None when the run left none."""
    try:
        rows = json.load(open(path))
        return rows[0] if rows else None
    except (OSError, ValueError):
        return None


def device_peak_gib(path):
    """The device-level peak that bench/device_peak.sh wrote (MiB above idle), in GiB, or None."""
    try:
        return int(open(path).read()) / 1024
    except (OSError, ValueError):
        return None
