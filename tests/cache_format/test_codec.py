"""The fp8 codec against a per-token, per-layer loop."""
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
