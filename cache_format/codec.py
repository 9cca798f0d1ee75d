"""How tensors become stored bytes and back: bf16 bits, fp8 or mxfp4 with scales, compression,
checksums.

zarr v3 (3.1 and 3.4) has no bfloat16 dtype, so bf16 is stored as its uint16 bit pattern and viewed
back without a copy. fp8_e4m3 stores one float32 scale per token per tapped layer (amax / 448), so
an outlier layer does not crush the others' precision. mxfp4 stores 4-bit values with one
power-of-two scale byte per 32 values (cache_format.mxfp4): 0.266x the bytes of bf16.
The quantized dtypes share one shape of storage: "hidden" holds uint8 bits, "hidden_scale" the
scales.
"""

from __future__ import annotations

from typing import NamedTuple

import google_crc32c
import numpy as np
import torch

from cache_format.mxfp4 import BLOCK as MX_BLOCK
from cache_format.mxfp4 import mxfp4_dequantize, mxfp4_quantize

__all__ = [
    "FP8_MAX",
    "QUANTIZED",
    "QuantRows",
    "bf16_to_bits",
    "bits_to_bf16",
    "checksum",
    "compressors_for",
    "dequantize",
    "file_checksum",
    "fp8_dequantize",
    "fp8_quantize",
    "quantize",
    "quantized_to_bf16",
    "scale_layout",
]

# Stored dtypes whose hidden states are uint8 bits beside a "hidden_scale" array.
QUANTIZED = ("fp8_e4m3", "mxfp4")

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def bf16_to_bits(x: torch.Tensor) -> np.ndarray:
    """bf16 tensor [..., D] on CPU -> uint16 numpy array sharing its memory."""
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    return x.contiguous().view(torch.uint16).numpy()


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    """uint16 numpy array -> bf16 tensor sharing its memory (no copy)."""
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bfloat16)


class QuantRows(NamedTuple):
    """Rows already quantized (on the GPU, by stage one): what ShardWriter.add stores for fp8 or
    mxfp4."""

    bits: torch.Tensor  # uint8 [T, K*H] (fp8 bit patterns) or [T, K*H/2] (two mxfp4 values a byte)
    scales: torch.Tensor  # float32 [T, K] (fp8) or uint8 [T, K*H/32] (mxfp4 e8m0)
    sq_err: float  # sum of squared quantization error over these rows
    sq_ref: float  # sum of squares of the unquantized rows

    @classmethod
    def of(cls, x: torch.Tensor, num_taps: int, dtype: str) -> QuantRows:
        """x [T, K*H] -> its quantized rows in `dtype` (with the squared error quantization
        made)."""
        bits, scales, err, ref = quantize(x, num_taps, dtype)
        return cls(bits, scales, float(err.sum()), float(ref.sum()))


def scale_layout(dtype: str, num_taps: int, hidden_size: int) -> tuple[int, int, str]:
    """(bytes of "hidden" per token, values of "hidden_scale" per token, its numpy dtype) of a
    quantized dtype."""
    if dtype == "fp8_e4m3":
        return num_taps * hidden_size, num_taps, "float32"
    if dtype == "mxfp4":
        return num_taps * hidden_size // 2, num_taps * hidden_size // MX_BLOCK, "uint8"
    raise ValueError(f"{dtype!r} is not a quantized dtype {QUANTIZED}")


def quantize(x: torch.Tensor, num_taps: int,
             dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K*H] -> (bits, scales, per-token squared error, per-token squared value) in
    `dtype`."""
    if dtype == "fp8_e4m3":
        return fp8_quantize(x, num_taps)
    if dtype == "mxfp4":
        return mxfp4_quantize(x)
    raise ValueError(f"{dtype!r} is not a quantized dtype {QUANTIZED}")


def dequantize(bits: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored bits and scales -> `dtype` (float32 or bfloat16) [..., K*H] on their device: the
    float32 values rounded once. The scales tell the codec apart: float32 ones are fp8's (per token
    and layer), uint8 ones mxfp4's e8m0 exponents."""
    if scales.dtype == torch.uint8:
        return mxfp4_dequantize(bits, scales).to(dtype)
    return fp8_dequantize(bits, scales, dtype)


def fp8_quantize(x: torch.Tensor,
                 num_taps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K*H] (any float dtype, any device) -> bits, scales, and the error that quantization
    made.

    Returns uint8 bits [..., K*H], float32 scales [..., K], and per token [...] the float64 sums
    over K*H of the squared quantization error and of the squared value (what inspect reports as the
    relative RMS error). One float32 copy of x is scaled, rounded and differenced in place: stage
    one runs this on every batch, and each extra full-width pass costs GPU time the forward waits
    for.
    """
    *lead, width = x.shape
    y = x.to(torch.float32, copy=True).reshape(*lead, num_taps, width // num_taps)  # [..., K, H]
    amax = torch.linalg.vector_norm(y, float("inf"), dim=-1, keepdim=True)  # [..., K, 1]
    ref = torch.linalg.vector_norm(y, dim=-1).double().square()  # [..., K]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [..., K, 1]
    y.div_(scale)
    q = y.to(torch.float8_e4m3fn)  # [..., K, H]
    y.sub_(q.float())  # the error in units of the scale
    # [..., K]
    err = torch.linalg.vector_norm(y, dim=-1).double().square() * scale[..., 0].double().square()
    return (q.reshape(*lead, width).view(torch.uint8), scale.reshape(*lead, num_taps),
            err.sum(-1), ref.sum(-1))


def fp8_dequantize(bits: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(uint8 [..., K*H], float32 [..., K]) -> `dtype` [..., K*H], on their device. fp8 values
    are exact in bf16 as in float32, so the bits are widened to `dtype` (bf16: half float32's
    bytes) and each float32 product with its scale is rounded to `dtype` once, as it is written:
    bf16 in two passes, with no float32 copy of the taps."""
    *lead, width = bits.shape
    k = scales.shape[-1]
    q = bits.view(torch.float8_e4m3fn).reshape(*lead, k, width // k).to(dtype)  # [..., K, H]
    return torch.mul(q, scales[..., None], out=torch.empty_like(q)).reshape(*lead, width)


def quantized_to_bf16(bits: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    """Stored "hidden" and "hidden_scale" arrays of a quantized store -> bf16 [T, K*H]."""
    b = torch.from_numpy(np.ascontiguousarray(bits))
    s = torch.from_numpy(np.ascontiguousarray(scales))
    return dequantize(b, s, torch.bfloat16)


def compressors_for(compression: str, typesize: int) -> object | None:
    """zarr `compressors=` argument for a manifest compression name."""
    if compression == "none":
        return None
    from zarr.codecs import BloscCodec

    # zstd level 1 + byte shuffle over 1 MiB blocks: 1.43x on bf16 at ~3 GB/s decode; the
    # default zstd(0) and blosc's automatic block size reach only ~1.24x (measured on bf16 hidden
    # states).
    return BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=typesize,
                      blocksize=1 << 20)


def checksum(arr: np.ndarray) -> int:
    """crc32c of an array's bytes in C order (hardware-accelerated, ~10 GB/s)."""
    c = google_crc32c.Checksum()
    c.update(np.ascontiguousarray(arr))
    return int.from_bytes(c.digest(), "big")


def file_checksum(path: str) -> int:
    """crc32c of a file's bytes."""
    c = google_crc32c.Checksum()
    with open(path, "rb") as f:
        c.update(f.read())
    return int.from_bytes(c.digest(), "big")
