"""One-off probe (deleted after its figures are recorded): FlexAttention forward+backward at the
Qwen3-8B drafter's training shape, default kernel options vs tuned block sizes / autotune."""
import sys
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from train.masks import flex_block_mask

torch.manual_seed(0)
dev = torch.device("cuda")
B, CTX, N, BS, H, KV, HD = 8, 2048, 512, 16, 32, 8, 128
g = torch.Generator().manual_seed(0)
anchors = torch.stack([torch.randperm(CTX - 20, generator=g)[:N].sort().values for _ in range(B)]).to(dev)
mask = flex_block_mask(anchors, CTX, BS)
q = torch.randn(B, H, N * BS, HD, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, KV, CTX + N * BS, HD, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, KV, CTX + N * BS, HD, device=dev, dtype=torch.bfloat16, requires_grad=True)
print(torch.__version__, "mask sparsity", mask.sparsity(), flush=True)


def bench(name, fn, opts):
    def step():
        o = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
        o.backward(torch.ones_like(o))
    try:
        t0 = time.perf_counter()
        step(); torch.cuda.synchronize()
        comp = time.perf_counter() - t0
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        fw = bw = 0.0
        for _ in range(10):
            e0.record(); o = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts); e1.record()
            o.backward(torch.ones_like(o)); e2.record(); torch.cuda.synchronize()
            fw += e0.elapsed_time(e1); bw += e1.elapsed_time(e2)
        print(f"{name:40s} fwd {fw / 10:7.2f} ms  bwd {bw / 10:7.2f} ms  (first call {comp:.0f} s)", flush=True)
    except Exception as e:  # a config the kernel rejects
        print(f"{name:40s} failed: {str(e).splitlines()[0][:150]}", flush=True)


default = torch.compile(flex_attention, dynamic=False)
bench("default", default, None)
for opts in ({"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
             {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64},
             {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 3},
             {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8, "num_stages": 2},
             {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}):
    bench(str(opts), default, opts)
if "--autotune" in sys.argv:
    torch._dynamo.reset()
    bench("max-autotune-no-cudagraphs", torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs"), None)
