"""A process's place in a launch, as torchrun's environment gives it; shared by both stages.

One process per GPU: rank r of WORLD_SIZE takes cuda:LOCAL_RANK (or the CPU where there is no GPU)
and, with more than one rank, joins the process group over nccl on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["World", "any_rank"]


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    """Ranks on this host (they share its cores)."""

    @classmethod
    def from_env(cls) -> World:
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                   int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1)))

    @property
    def device(self) -> torch.device:
        return torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")

    def join(self) -> torch.device:
        """Select this rank's device and join the process group (where there are several ranks)."""
        device = self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return device

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def any_rank(flag: bool, device: torch.device, world: int) -> bool:
    """Whether `flag` holds on any rank (every rank calls this at the same step, so all stop
    alike)."""
    t = torch.tensor([float(flag)], device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
