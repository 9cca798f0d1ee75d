"""A store writer in its own process, reading batches in place from a shared host ring.

A writer thread in the GPU process competes with the forward loop for the GIL (its row copies,
checksums and bookkeeping run in Python). Here the device-to-host copy lands in a slot of a
shared-memory ring (extract/ring.py) that the writer process reads in place, so the GPU process
only launches copies and passes small messages. `run_batches` drives each ProcessWriter from one
thread of its own: `write` sends one item and waits for the child to finish it, so the ring slot
can be given back.
"""

from __future__ import annotations

import os
import queue
import signal
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp  # registers tensor reductions: shared storage, not pickled bytes

from cache_format import CacheFormatError, ShardWriter
from cache_format.codec import QuantRows
from extract.ring import HostRing
from runtime.preemption import Preemption

__all__ = ["ProcessWriter", "WriteItem"]


@dataclass
class WriteItem:
    """Samples `rows` of the batch held in ring slot `slot` (padded to `seq` tokens)."""

    slot: int
    batch: int  # samples in the batch (the slot's view shape)
    seq: int
    rows: list[int]
    sample_ids: list[int]
    input_ids: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    ok: list[bool]
    # per sample (squared error, squared ref), GPU-quantized
    quant_sq: list[tuple[float, float]] | None = None


def write_rows(writer, views: dict[str, torch.Tensor], item: WriteItem) -> int:
    """Add the item's samples to a ShardWriter from ring views [B, T, width]; returns the refused
    count.

    With a "hidden_scale" field the "hidden" field holds fp8 or mxfp4 bits quantized on the GPU.
    """
    refused = 0
    hid, last, scales = views["hidden"], views.get("last_hidden"), views.get("hidden_scale")
    for i, (j, sid, ids, mask, ok) in enumerate(zip(item.rows, item.sample_ids, item.input_ids,
                                                    item.loss_masks,
                                                   item.ok)):
        if not ok:
            refused += 1
            continue
        n = len(ids)
        hidden = hid[j, :n] if scales is None else QuantRows(hid[j, :n], scales[j, :n],
                                                             *item.quant_sq[i])
        writer.add(sid, input_ids=ids, loss_mask=mask, hidden=hidden,
                   last_hidden=last[j, :n] if last is not None else None)
    return refused


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when its parent dies: a SIGKILLed extraction must not leave
    its writers waiting on their inbox forever (prctl PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def _child(store: str, writer_id: int, ring: HostRing, inbox, outbox, parent: int) -> None:
    _die_with_parent(parent)
    # a signal to the process group is the parent's to act on: it stops feeding and closes this
    # writer, which commits what it holds (a parent that dies instead takes this process with it:
    # PDEATHSIG)
    for sig in Preemption.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        w = ShardWriter(store, writer_id=writer_id)
        outbox.put(("ready", None))
        while (item := inbox.get()) is not None:
            outbox.put(("done", write_rows(w, ring.views(item.slot, item.batch, item.seq), item)))
        w.close()
        outbox.put(("closed", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        outbox.put(("error", f"{type(e).__name__}: {e}" if not str(e).startswith("/") else str(e)))


class ProcessWriter:
    """Owns one writer process (writer id `writer_id`) reading from the shared `ring`."""

    def __init__(self, store: str, writer_id: int, ring: HostRing) -> None:
        ctx = mp.get_context("spawn")
        self.writer_id = writer_id
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child,
                                args=(store, writer_id, ring, self.inbox, self.outbox, os.getpid()),
                                daemon=True)
        self.proc.start()
        self._expect("ready")

    def _expect(self, what: str) -> object:
        while True:
            try:
                kind, payload = self.outbox.get(timeout=5.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise CacheFormatError("store writer process died (exit code "
                                           f"{self.proc.exitcode})") from None
                continue
            if kind == "error":
                raise CacheFormatError(str(payload))
            if kind == what:
                return payload

    def write(self, item: WriteItem) -> int:
        """Write the item's samples (the child reads the ring slot); returns the refused count."""
        self.inbox.put(item)
        return int(self._expect("done"))

    def close(self) -> None:
        self.inbox.put(None)
        try:
            self._expect("closed")
        finally:
            self.proc.join(60)
