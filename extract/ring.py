"""A ring of host buffers that forward batches are copied into and store writers read from.

Each slot holds one forward batch, as named flat fields: e.g. "hidden" [max_tokens * K*H] (bf16,
or the bits of an fp8 or mxfp4 store, quantized on the GPU), "hidden_scale" (quantized stores only),
"last_hidden" [max_tokens * H] (the store's names). The GPU loop takes a free slot, copies into it
without blocking and hands the slot to the writers; the last writer done with it gives it back. A
fixed ring instead of fresh `tensor.to("cpu", non_blocking=True)` copies matters on GPU:
page-locking 600 MB per Qwen3-8B batch on first use cost seconds in a short benchmark, and a fixed
ring bounds host RAM by construction (slots x max_tokens x bytes/token).

`shared=True` puts the ring in shared memory so writer processes read it in place.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

__all__ = ["HostRing"]


class HostRing:
    """`slots` host buffers for batches of at most `max_tokens` padded tokens.

    fields: name -> (values per token, dtype).
    """

    def __init__(self, slots: int, max_tokens: int, fields: dict[str, tuple[int, torch.dtype]],
                 *, pin: bool, shared: bool) -> None:
        if slots < 1 or max_tokens < 1:
            raise ValueError("a ring needs at least one slot of at least one token")
        self.max_tokens, self.fields = max_tokens, dict(fields)
        self.buffers: dict[str, torch.Tensor] = {}  # name -> [slots, max_tokens * width]
        for name, (width, dtype) in self.fields.items():
            # shared memory cannot be allocated pinned; it is page-locked in place below instead
            t = torch.empty(slots, max_tokens * width, dtype=dtype, pin_memory=pin and not shared)
            self.buffers[name] = t.share_memory_() if shared else t
        self._registered: list[torch.Tensor] = []
        if pin and shared:
            cudart = torch.cuda.cudart()
            for t in self.buffers.values():
                cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                self._registered.append(t)
        self._free: queue.Queue[int] = queue.Queue()
        for s in range(slots):
            self._free.put(s)
        self._holders = [0] * slots
        self._lock = threading.Lock()

    def take(self, failed: Callable[[], bool] = lambda: False) -> int | None:
        """A free slot, waiting for writers to give one back; None once `failed()` says a writer
        died."""
        while True:
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                if failed():
                    return None

    def views(self, slot: int, b: int, t: int) -> dict[str, torch.Tensor]:
        """The slot's fields as [b, t, width] tensors."""
        if b * t > self.max_tokens:
            raise ValueError(f"batch of {b} x {t} tokens exceeds the ring's {self.max_tokens} "
                             "tokens per slot")
        return {name: self.buffers[name][slot][: b * t * w].view(b, t, w)
                for name, (w, _) in self.fields.items()}

    def hold(self, slot: int, holders: int) -> None:
        """`holders` writers will each `release(slot)` once; the slot is free after the last."""
        with self._lock:
            self._holders[slot] = holders
        if holders == 0:
            self._free.put(slot)

    def release(self, slot: int) -> None:
        with self._lock:
            self._holders[slot] -= 1
            free = self._holders[slot] == 0
        if free:
            self._free.put(slot)

    def __getstate__(self) -> dict:
        # A writer process gets the shared tensors only; the free list stays with the GPU process.
        return {"max_tokens": self.max_tokens, "fields": self.fields, "buffers": self.buffers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _registered=[])

    def close(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for t in self._registered:
                cudart.cudaHostUnregister(t.data_ptr())
            self._registered.clear()
