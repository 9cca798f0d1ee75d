"""python -m bench trace FILE: where a profiled stretch of GPU time went, from its Chrome trace.

`python -m bench train --profile N --trace FILE` writes the trace (torch.profiler's Chrome format,
gzipped where the name ends in .gz). This sums it up as one JSON line:

- the window, first GPU activity to last (or from --from-ms into it), and the share of it in which
  no kernel, copy or memset ran on any stream (idle), with the longest idle gaps;
- per CUDA stream: its busy time (the union of its activities), its kernels and its copies;
- the host-to-device copies: their time, and how much of it ran while a kernel ran on another
  stream (overlapped) -- a copy meant to overlap the step before that does not shows here;
- the host's waits: the CUDA runtime's synchronize calls, their count and time.

Times in milliseconds. Intervals are [start, end) in the trace's microseconds.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

__all__ = ["merged", "union_length", "gaps", "overlap_length", "summarize", "main"]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals."""
    return sum(e - s for s, e in merged(intervals))


def gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The stretches of [lo, hi) that no interval covers, in order."""
    out, at = [], lo
    for s, e in merged(intervals):
        if s > at:
            out.append((at, min(s, hi)))
        at = max(at, e)
        if at >= hi:
            break
    if at < hi:
        out.append((at, hi))
    return [g for g in out if g[1] > g[0]]


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of (union of a) intersected with (union of b)."""
    a, b = merged(a), merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: not a readable Chrome trace ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise SystemExit(f"error: {path}: no traceEvents list in this JSON")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def _interval(e: dict) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _stream(e: dict) -> str:
    return str(e.get("args", {}).get("stream", "?"))


def summarize(events: list[dict], top: int = 5, from_ms: float = 0.0) -> dict:
    """The summary of module docstring from complete ("X") trace events; the idle share and gaps
    counted from `from_ms` into the window on."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        return {"gpu_events": 0}
    spans = [_interval(e) for e in gpu]
    first, hi = min(s for s, _ in spans), max(e for _, e in spans)
    lo = min(hi, first + from_ms * 1e3)
    idle = sorted(gaps(spans, lo, hi), key=lambda g: g[0] - g[1])
    streams: dict[str, dict] = {}
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[_stream(e)].append(e)
    for sid, evs in sorted(by_stream.items()):
        streams[sid] = {"busy_ms": union_length([_interval(e) for e in evs]) / 1e3,
                        "kernels": sum(e["cat"] == "kernel" for e in evs),
                        "copies": sum(e["cat"] == "gpu_memcpy" for e in evs)}
    h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    h2d_overlap = 0.0
    for sid in by_stream:  # each stream's copies against the kernels of the others
        own = [_interval(e) for e in h2d if _stream(e) == sid]
        others = [_interval(e) for e in gpu if e["cat"] == "kernel" and _stream(e) != sid]
        h2d_overlap += overlap_length(own, others)
    syncs = collections.Counter()
    sync_us = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and "ynchronize" in e.get("name", ""):
            syncs[e["name"]] += 1
            sync_us[e["name"]] += float(e["dur"])
    window, idle_us = hi - lo, sum(e - s for s, e in idle)
    return {"gpu_events": len(gpu), **({"from_ms": from_ms} if from_ms else {}),
            "window_ms": window / 1e3, "idle_ms": idle_us / 1e3,
            "idle_frac": idle_us / window if window else 0.0,
            "idle_gaps_longest_ms": [round((e - s) / 1e3, 3) for s, e in idle[:top]],
            "idle_gaps_over_50us": sum(e - s > 50 for s, e in idle),
            "streams": streams,
            "h2d_ms": union_length([_interval(e) for e in h2d]) / 1e3,
            "h2d_overlapped_ms": h2d_overlap / 1e3,
            "host_syncs": {k: {"count": syncs[k], "ms": sync_us[k] / 1e3} for k in syncs}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench trace", description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a Chrome trace from bench train --profile N --trace FILE")
    ap.add_argument("--top", type=int, default=5, help="how many of the longest idle gaps to list")
    ap.add_argument("--from-ms", type=float, default=0.0,
                    help="count the idle share from this far into the window on: the profiled steps start "
                         "after a sync, so the GPU idles while the host queues the first one")
    a = ap.parse_args(argv)
    if not a.trace.is_file():
        raise SystemExit(f"error: {a.trace}: no such file")
    if a.from_ms < 0:
        raise SystemExit(f"error: --from-ms {a.from_ms}: must be >= 0")
    json.dump(summarize(_events(a.trace), a.top, a.from_ms), sys.stdout)
    print()


if __name__ == "__main__":
    main()
