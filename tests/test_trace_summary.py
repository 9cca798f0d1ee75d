"""bench.trace_summary: interval maths against a unit-grid oracle; a synthetic trace summed up."""

import gzip
import json
import random
import subprocess
import sys

from bench.trace_summary import gaps, merged, overlap_length, summarize, union_length


def _cells(intervals):  # the oracle: which unit cells of the grid the intervals cover
    return {c for s, e in intervals for c in range(s, e)}


def test_interval_maths_match_a_unit_grid():
    rng = random.Random(0)
    for _ in range(300):
        a = [(s, s + rng.randint(0, 8)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 7)))]
        b = [(s, s + rng.randint(0, 8)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 7)))]
        assert union_length(a) == len(_cells(a))
        assert overlap_length(a, b) == len(_cells(a) & _cells(b))
        m = merged(a)
        assert all(m[i][1] < m[i + 1][0] for i in range(len(m) - 1))  # disjoint and not touching
        lo, hi = 5, 35
        assert _cells(gaps(a, lo, hi)) == set(range(lo, hi)) - _cells(a)


def _trace():
    k = lambda ts, dur, stream: {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur,  # noqa: E731
                                 "args": {"stream": stream}}
    return {"traceEvents": [
        k(0, 100, 7), k(100, 50, 7), k(400, 100, 7),          # compute: idle 150..300 (copy) and 300..400
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 120, "dur": 180,
         "args": {"stream": 20}},                              # 30 us beside a kernel, 150 us alone
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 310, "dur": 90},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0}]}


def test_a_trace_summed_up(tmp_path):
    s = summarize([e for e in _trace()["traceEvents"] if e["ph"] == "X"])
    assert s["gpu_events"] == 4 and s["window_ms"] == 0.5
    assert s["idle_ms"] == 0.1 and s["idle_gaps_longest_ms"] == [0.1] and s["idle_gaps_over_50us"] == 1
    assert s["streams"]["7"] == {"busy_ms": 0.25, "kernels": 3, "copies": 0}
    assert s["h2d_ms"] == 0.18 and abs(s["h2d_overlapped_ms"] - 0.03) < 1e-12
    assert s["host_syncs"] == {"cudaStreamSynchronize": {"count": 1, "ms": 0.09}}
    # from 0.35 ms into the window on: 350..500, idle 350..400
    late = summarize([e for e in _trace()["traceEvents"] if e["ph"] == "X"], from_ms=0.35)
    assert late["from_ms"] == 0.35 and abs(late["window_ms"] - 0.15) < 1e-12
    assert abs(late["idle_ms"] - 0.05) < 1e-12 and late["idle_gaps_longest_ms"] == [0.05]
    f = tmp_path / "t.json.gz"
    with gzip.open(f, "wt") as out:
        json.dump(_trace(), out)
    p = subprocess.run([sys.executable, "-m", "bench", "trace", str(f)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["idle_ms"] == 0.1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    p = subprocess.run([sys.executable, "-m", "bench", "trace", str(bad)], capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.strip().startswith(f"error: {bad}: not a readable Chrome trace")
    assert len(p.stderr.strip().splitlines()) == 1
