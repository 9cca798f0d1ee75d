"""Bytes, error and lossless compression of each stored dtype, on real hidden states (CPU).

    python -m bench codec --store stores/demo.zarr          # a bf16 store of the real target's taps

Reads the taps of a bfloat16 store (the real target's states, as extracted), quantizes them with
each codec of the store (fp8_e4m3: a float32 scale per token and layer; mxfp4: 4-bit values, a
power-of-two scale per 32) and reports, per codec: bytes per token of values and scales, their
ratio to bf16, the relative RMS error, and what a lossless compressor saves on top (zstd levels 1
and 3; blosc zstd level 1 with byte shuffle and with bit shuffle), each over blocks of 1 MiB as a
shard's chunks would be, with its compress and decompress MB/s on this machine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import checked_store
from cache_format.codec import bf16_to_bits, dequantize, quantize

BLOCK = 1 << 20


def _compressors() -> dict[str, object]:
    from numcodecs import Blosc, Zstd

    return {"zstd1": Zstd(level=1), "zstd3": Zstd(level=3),
            "blosc-zstd1-shuffle": Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=BLOCK),
            "blosc-zstd1-bitshuffle": Blosc(cname="zstd", clevel=1, shuffle=Blosc.BITSHUFFLE, blocksize=BLOCK)}


def _lossless(arrays: list[np.ndarray]) -> dict[str, dict[str, float]]:
    """Ratio and MB/s of each compressor over the arrays' bytes in 1 MiB blocks."""
    raw = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    blocks = [raw[i:i + BLOCK] for i in range(0, len(raw), BLOCK)]
    out = {}
    for name, codec in _compressors().items():
        t0 = time.perf_counter()
        packed = [codec.encode(b) for b in blocks]
        t1 = time.perf_counter()
        for p in packed:
            codec.decode(p)
        t2 = time.perf_counter()
        size = sum(len(p) for p in packed)
        out[name] = {"ratio": len(raw) / size, "compress_MBps": len(raw) / 1e6 / (t1 - t0),
                     "decompress_MBps": len(raw) / 1e6 / (t2 - t1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a bfloat16 store (the states to measure)")
    ap.add_argument("--samples", type=int, default=0, help="read only this many samples (0 = all)")
    a = ap.parse_args()
    r = checked_store(a.store)
    m = r.manifest
    if m.dtype != "bfloat16":
        raise SystemExit(f"error: {a.store}: a bfloat16 store is needed (this one is {m.dtype})")
    ids = r.sample_ids[: a.samples or None].tolist()
    x = torch.cat([s.hidden for s in r.get_batch(ids)])  # [T, K*H] bf16, the real states
    k, h = len(m.layer_ids), m.target.hidden_size
    tokens = x.shape[0]
    bf16_bytes = 2 * k * h
    res = {"store": a.store, "target": m.target.name, "tokens": tokens, "taps": k, "hidden": h, "codecs": {}}
    res["codecs"]["bfloat16"] = {"bytes_per_token": bf16_bytes, "vs_bf16": 1.0, "relative_rms_error": 0.0,
                                 "lossless": _lossless([bf16_to_bits(x)])}
    for dtype in ("fp8_e4m3", "mxfp4"):
        t0 = time.perf_counter()
        bits, scales, err, ref = quantize(x, k, dtype)
        q_s = time.perf_counter() - t0
        back = dequantize(bits, scales)
        nbytes = (bits.numel() * bits.element_size() + scales.numel() * scales.element_size()) / tokens
        res["codecs"][dtype] = {
            "bytes_per_token": nbytes, "vs_bf16": nbytes / bf16_bytes,
            "relative_rms_error": float((err.sum() / ref.sum()).sqrt()),
            "relative_rms_error_check": float((back - x.float()).norm() / x.float().norm()),
            "quantize_MBps_cpu": tokens * bf16_bytes / 1e6 / q_s,
            "lossless": _lossless([bits.numpy(), scales.numpy()]),
        }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
