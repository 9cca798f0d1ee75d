"""MXFP4: 4-bit e2m1 values with one power-of-two (e8m0) scale per block of 32 values.

The format is that of the OCP Microscaling (MX) specification v1.0: an element is a 4-bit float
with 1 sign, 2 exponent and 1 mantissa bit (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf or NaN),
and a block of 32 consecutive elements shares a scale 2^(e - 127) stored as the unsigned byte e
(e = 255 is NaN). Two elements pack into one byte, the element of even index in the low nibble.
A token's row of K*H values thus costs K*H/2 bytes of elements plus K*H/32 bytes of scales:
4.25 bits a value, 0.266x bf16.

The scale: the specification takes 2^(floor(log2 amax) - 2), which puts the block's largest
magnitude in [4, 8) and clips it to 6 when it lands above. Here the scale is the smallest power of
two with amax / scale <= 6, so nothing clips (the largest value lands in (3, 6]). Elements round to
the nearest e2m1 value. Blocks never cross a tapped layer (H must be a multiple of 32), so the taps
of one row can be selected from the packed bytes and the scales alike.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "E2M1_VALUES", "mxfp4_dequantize", "mxfp4_quantize"]

BLOCK = 32
E2M1_MAX = 6.0
# magnitude of each 3-bit code; the fourth bit is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# a magnitude above midpoint i rounds to code i + 1
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _lut(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each 4-bit code (sign in bit 3)."""
    mag = torch.tensor(E2M1_VALUES, device=device)
    return torch.cat([mag, -mag])


def mxfp4_quantize(
        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., W] (W a multiple of 32; any float dtype and device) -> packed uint8 [..., W/2],
    e8m0 scales uint8 [..., W/32], and per row [...] the float64 sums of the squared quantization
    error and of the squared value (inspect's relative RMS error).

    Stage one runs this on every batch on the GPU, where each full-width pass costs forward time:
    magnitudes are coded in int32 (not int64) and the sign joins them as bytes; the error is taken
    from the magnitudes (a value and its code share a sign) and the reference from the same float
    copy, so the batch is read about half as often as a straightforward version would.
    """
    *lead, width = x.shape
    if width % BLOCK:
        raise ValueError(f"mxfp4 needs rows of a multiple of {BLOCK} values, got {width}")
    y = x.to(torch.float32, copy=True).reshape(*lead, width // BLOCK, BLOCK)  # [..., nb, 32]
    ref = torch.linalg.vector_norm(y, dim=(-2, -1)).double().square()  # [...]
    amax = torch.linalg.vector_norm(y, float("inf"), dim=-1, keepdim=True)  # [..., nb, 1]
    mant, expo = torch.frexp(amax / E2M1_MAX)  # amax/6 = mant * 2^expo, mant in [0.5, 1)
    # smallest p with 2^p >= amax / 6: expo, or expo - 1 when amax / 6 is itself a power of two
    p = torch.where(mant == 0.5, expo - 1, expo)
    e = torch.where(amax > 0, (p + 127).clamp(0, 254), torch.zeros_like(p))  # [..., nb, 1]
    scale = torch.ldexp(torch.ones_like(amax), e - 127)
    y.div_(scale)  # a power of two: exact
    neg = y < 0  # [..., nb, 32] bool
    y.abs_()
    # codes 0..7
    mag = torch.bucketize(y, torch.tensor(_MIDPOINTS, device=y.device), out_int32=True)
    # |value| - |its code's value| (codes 0..7: the positive half): the error
    y.sub_(_lut(y.device)[mag])
    # [...]
    err = (torch.linalg.vector_norm(y, dim=-1).double() * scale[..., 0].double()).square().sum(-1)
    code = mag.to(torch.uint8)
    code |= (neg & (code > 0)).to(torch.uint8) << 3  # the sign bit; no negative zero
    code = code.reshape(*lead, width // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed, e.reshape(*lead, width // BLOCK).to(torch.uint8), err, ref


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(packed uint8 [..., W/2], e8m0 uint8 [..., W/32]) -> float32 [..., W], on their device."""
    *lead, half = packed.shape
    # [..., W]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, half * 2).long()
    vals = _lut(packed.device)[codes].reshape(*lead, half * 2 // BLOCK, BLOCK)
    # [..., W/32]
    scale = torch.ldexp(torch.ones(scales.shape, device=packed.device),
                        scales.to(torch.int32) - 127)
    return (vals * scale[..., None]).reshape(*lead, half * 2)
