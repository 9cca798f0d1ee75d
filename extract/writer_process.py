"""A store writer in its own process, fed through shared (and, on GPU, pinned) host buffers.

One writer thread in the GPU process reached 1.07 GB/s (85% of the bare forward for a
Qwen3-8B-shaped target; docs/BENCHMARKS.md): its copies, checksums and file writes compete with the
forward loop for the GIL. Here the device-to-host copy lands directly in a slot of a shared-memory
ring that the writer process reads in place, so the GPU process only launches copies and passes
small messages. The ring has `slots` batches: host RAM stays bounded and a slow disk slows the
producer instead of growing memory.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp  # registers tensor reductions: shared storage, not pickled bytes

__all__ = ["ProcessWriter"]


@dataclass
class _Item:
    slot: int
    sample_ids: list[int]
    lengths: list[int]
    input_ids: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    ok: list[bool]
    seq: int  # padded length T of this batch


def _child(store: str, writer_id: int, width: int, last_width: int, ring_hid, ring_last, inbox, outbox) -> None:
    from cache_format import ShardWriter

    try:
        w = ShardWriter(store, writer_id=writer_id)
        outbox.put(("ready", None))
        while (item := inbox.get()) is not None:
            hid = ring_hid[item.slot][: len(item.sample_ids) * item.seq * width].view(-1, item.seq, width)
            last = None
            if ring_last is not None:
                last = ring_last[item.slot][: len(item.sample_ids) * item.seq * last_width].view(-1, item.seq, last_width)
            refused = 0
            for j, sid in enumerate(item.sample_ids):
                if not item.ok[j]:
                    refused += 1
                    continue
                n = item.lengths[j]
                w.add(sid, input_ids=item.input_ids[j], loss_mask=item.loss_masks[j], hidden=hid[j, :n],
                      last_hidden=last[j, :n] if last is not None else None)
            outbox.put(("free", (item.slot, refused)))
        w.close()
        outbox.put(("closed", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        outbox.put(("error", f"{type(e).__name__}: {e}" if not str(e).startswith("/") else str(e)))


class ProcessWriter:
    """Owns a writer process and a ring of host buffers [slots, max_tokens * width] (bf16)."""

    def __init__(self, store: str, writer_id: int, *, width: int, last_width: int, max_tokens: int, slots: int,
                 pin: bool) -> None:
        ctx = mp.get_context("spawn")
        self.writer_id = writer_id
        self.ring_hid = torch.empty(slots, max_tokens * width, dtype=torch.bfloat16).share_memory_()
        self.ring_last = (torch.empty(slots, max_tokens * last_width, dtype=torch.bfloat16).share_memory_()
                          if last_width else None)
        self._pinned = []
        if pin:  # page-lock the shared ring so device-to-host copies run asynchronously at full speed
            cudart = torch.cuda.cudart()
            for t in (self.ring_hid, self.ring_last):
                if t is not None:
                    cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                    self._pinned.append(t)
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child, args=(store, writer_id, width, last_width, self.ring_hid, self.ring_last,
                                                      self.inbox, self.outbox), daemon=True)
        self.proc.start()
        self.free = list(range(slots))
        self.refused = 0
        self._expect("ready")

    def _expect(self, what: str) -> object:
        from cache_format import CacheFormatError

        while True:
            try:
                kind, payload = self.outbox.get(timeout=5.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise CacheFormatError(f"store writer process died (exit code {self.proc.exitcode})") from None
                continue
            if kind == "error":
                raise CacheFormatError(str(payload))
            if kind == "free":
                slot, refused = payload
                self.free.append(slot)
                self.refused += refused
                if what == "free":
                    return slot
                continue
            if kind == what:
                return payload

    def slot(self) -> int:
        """A free ring slot, waiting for the writer to release one if all are in use."""
        if not self.free:
            self._expect("free")
        return self.free.pop()

    def submit(self, item: _Item) -> None:
        self.inbox.put(item)

    def close(self) -> None:
        self.inbox.put(None)
        try:
            self._expect("closed")
        finally:
            self.proc.join(60)
            if self._pinned:
                cudart = torch.cuda.cudart()
                for t in self._pinned:
                    cudart.cudaHostUnregister(t.data_ptr())
