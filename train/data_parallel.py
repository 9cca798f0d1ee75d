"""DDP for the drafter: the wrapper, and the comm hook that all-reduces gradients in bf16."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["data_parallel"]


def data_parallel(model: torch.nn.Module, *,
                  grad_reduce: str) -> torch.nn.parallel.DistributedDataParallel:
    """DDP over the initialised process group, all-reducing gradients in `grad_reduce` (fp32 or
    bf16)."""
    # gradients as views of the all-reduce buckets: no copy into them each step, and 4 bytes a
    # parameter less memory
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if grad_reduce == "bf16":
        ddp.register_comm_hook(None, _bf16_all_reduce)
    return ddp


# no annotations: DDP checks them, and these would be strings here
def _bf16_all_reduce(_state, bucket):
    """A DDP comm hook (bucket: dist.GradBucket -> Future of its tensor): the bucket's mean over
    ranks, summed in bf16. PyTorch's own bf16 hook refuses anything but NCCL, and the CPU tests run
    gloo."""
    buf = bucket.buffer()  # [n] fp32 gradients of this bucket
    # divided first: the sum stays in range
    half = buf.to(torch.bfloat16).div_(dist.get_world_size())
    # Not async + Future.then: a Python callback run on gloo's thread aborted a rank at exit in 4 of
    # 50 CPU runs of tests/train/ddp_reduce_probe.py (0 of 20 since). With NCCL this call returns
    # once the all-reduce is queued on its stream and the copy below is ordered after it, so the GPU
    # still overlaps it with the rest of backward.
    dist.all_reduce(half)
    buf.copy_(half)
    done = torch.futures.Future()
    done.set_result(buf)
    return done
