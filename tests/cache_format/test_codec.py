"""The fp8 and mxfp4 codecs against per-token, per-layer and per-block loops."""
import pytest
import torch

from cache_format.codec import FP8_MAX, fp8_dequantize, fp8_quantize


def _naive(x: torch.Tensor, k: int):
    """One token and one layer at a time, float64 sums: what fp8_quantize must equal."""
    t, width = x.shape
    h = width // k
    bits = torch.empty(t, width, dtype=torch.uint8)
    scales = torch.empty(t, k)
    err = torch.zeros(t, dtype=torch.float64)
    ref = torch.zeros(t, dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            row = x[i, j * h:(j + 1) * h].float()
            amax = row.abs().max()
            s = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
            q = (row / s).to(torch.float8_e4m3fn)
            bits[i, j * h:(j + 1) * h] = q.view(torch.uint8)
            scales[i, j] = s
            err[i] += ((q.double() * s.double() - row.double()) ** 2).sum()
            ref[i] += (row.double() ** 2).sum()
    return bits, scales, err, ref


def test_fp8_quantize_equals_a_per_token_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3 * 64, generator=g) * torch.logspace(-3, 3, 7)[:, None]  # [T, K*H], scales apart
    x[2, 64:128] = 0  # a zero layer row: scale 1, no error, no division by zero
    for xin in (x, x.bfloat16()):
        kept = xin.clone()
        bits, scales, err, ref = fp8_quantize(xin, 3)
        nb, ns, ne, nr = _naive(xin, 3)
        assert torch.equal(xin, kept)  # a float32 input is copied, never scaled in place
        assert torch.equal(bits, nb) and torch.equal(scales, ns)
        assert scales[2, 1] == 1 and err.dtype == ref.dtype == torch.float64
        torch.testing.assert_close(err, ne, rtol=1e-5, atol=0)
        torch.testing.assert_close(ref, nr, rtol=1e-6, atol=0)
        back = fp8_dequantize(bits, scales).double()  # the reader's float32 path: the error it measures
        torch.testing.assert_close(((back - xin.double()) ** 2).sum(-1), ne, rtol=1e-5, atol=0)


def test_fp8_quantize_keeps_leading_dims():
    x = torch.randn(2, 5, 4 * 16)  # [B, T, K*H]
    bits, scales, err, ref = fp8_quantize(x, 4)
    assert bits.shape == (2, 5, 64) and scales.shape == (2, 5, 4) and err.shape == ref.shape == (2, 5)
    flat = fp8_quantize(x.reshape(10, 64), 4)
    assert torch.equal(bits.reshape(10, 64), flat[0]) and torch.allclose(err.reshape(10), flat[2])


def _mx_naive(x: torch.Tensor):
    """MXFP4 one block of 32 values at a time, in Python floats: the scale is the smallest power of
    two that brings the block's largest magnitude to <= 6, each value goes to the nearest e2m1
    magnitude (ties to the smaller), two codes a byte, the even index in the low nibble."""
    from cache_format.mxfp4 import E2M1_VALUES

    t, width = x.shape
    codes, exps = [], []
    err = torch.zeros(t, dtype=torch.float64)
    for i in range(t):
        row_codes, row_exps = [], []
        for b in range(0, width, 32):
            block = [float(v) for v in x[i, b:b + 32]]
            amax = max(abs(v) for v in block)
            p = -127
            while amax > 0 and 2.0 ** p * 6 < amax:
                p += 1
            e = p + 127 if amax > 0 else 0
            scale = 2.0 ** (e - 127)
            row_exps.append(e)
            for v in block:
                y = abs(v) / scale
                c = min(range(8), key=lambda k: (abs(E2M1_VALUES[k] - y), k))
                row_codes.append(c + (8 if v < 0 and c else 0))
                err[i] += ((E2M1_VALUES[c] * scale * (1 if v >= 0 else -1)) - v) ** 2
        codes.append(row_codes)
        exps.append(row_exps)
    c = torch.tensor(codes, dtype=torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4), torch.tensor(exps, dtype=torch.uint8), err


def test_mxfp4_quantize_equals_a_per_block_loop():
    from cache_format.mxfp4 import mxfp4_dequantize, mxfp4_quantize

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3 * 64, generator=g) * torch.logspace(-4, 4, 5)[:, None]  # [T, K*H], scales apart
    x[2, :32] = 0  # an all-zero block
    packed, scales, err, ref = mxfp4_quantize(x)
    want_packed, want_scales, want_err = _mx_naive(x)
    assert torch.equal(scales, want_scales) and torch.equal(packed, want_packed)
    torch.testing.assert_close(err, want_err, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(ref, (x.double() ** 2).sum(-1), rtol=1e-6, atol=0)
    back = mxfp4_dequantize(packed, scales).double()
    torch.testing.assert_close(((back - x.double()) ** 2).sum(-1), err, rtol=1e-5, atol=1e-12)


def test_mxfp4_represents_its_own_grid_exactly_and_packs_half_a_byte_a_value():
    from cache_format.codec import dequantize, quantize, scale_layout

    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0] * 4)[None] * 2.0 ** -20
    bits, scales, err, _ = quantize(grid, 1, "mxfp4")
    assert bits.shape == (1, 32) and scales.shape == (1, 2) and float(err.sum()) == 0.0
    assert torch.equal(dequantize(bits, scales), grid)
    # bytes a token: K*H/2 of values and K*H/32 of scales, 0.266x bf16 for SmolLM2's 5 x 576 taps
    nbytes, nscales, dtype = scale_layout("mxfp4", 5, 576)
    assert (nbytes + nscales) / (2 * 5 * 576) < 0.27 and dtype == "uint8"
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.ones(1, 48), 1, "mxfp4")


def test_dequantize_to_bf16_gives_the_float32_path_rounded_bit_for_bit():
    from cache_format.codec import dequantize

    g = torch.Generator().manual_seed(0)
    k, h = 3, 256
    # every fp8 bit pattern (NaNs and subnormals included) in each tap of each token
    bits = torch.arange(256, dtype=torch.uint8).repeat(5, k)  # [5, K*H]
    bits = bits[torch.randperm(5, generator=g)].reshape(5, k * h)
    scales = torch.exp(torch.randn(5, k, generator=g) * 8)  # [5, K]: tiny to huge
    want = dequantize(bits, scales).to(torch.bfloat16)
    got = dequantize(bits, scales, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the mxfp4 scales (uint8 exponents) take its own decode, rounded the same way
    mx_bits = torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=g)
    mx_scales = torch.randint(100, 150, (4, 4), dtype=torch.uint8, generator=g)
    assert torch.equal(dequantize(mx_bits, mx_scales, torch.bfloat16), dequantize(mx_bits, mx_scales).to(torch.bfloat16))
