"""The forward -> host -> store pipeline of one rank, shared by `extract.run` and the benchmark.

The GPU thread (the caller) runs the decoder stack with hooks, starts non-blocking device-to-host
copies and queues the batch; a writer thread waits on the copy's event and feeds the ShardWriter.
The queue is bounded, so host RAM is bounded and a slow disk slows the GPU rather than OOMing.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from cache_format import ShardWriter
from cache_format.target import capture, decoder_parts
from extract.data import Rendered
from extract.writer_process import ProcessWriter, _Item

__all__ = ["run_batches"]


def _pad(batch: Sequence[Rendered], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = [len(r.input_ids) for r in batch]
    ids = torch.zeros(len(batch), max(lens), dtype=torch.long)
    att = torch.zeros_like(ids)
    for j, r in enumerate(batch):
        ids[j, : lens[j]] = r.input_ids
        att[j, : lens[j]] = 1
    if device.type == "cuda":
        ids, att = ids.pin_memory(), att.pin_memory()
    return ids.to(device, non_blocking=True), att.to(device, non_blocking=True)


def run_batches(model: torch.nn.Module, layer_ids: list[int], batches: Sequence[Sequence[Rendered]],
                writers: Sequence[ShardWriter | ProcessWriter], *, last_hidden: bool, queue_batches: int,
                on_batch: Callable[[int], None] = lambda n: None) -> Counter:
    """Extract every batch; returns counts of refused samples.

    Batch i goes to writer thread i % len(writers), each with its own ShardWriter (writer id), so
    disk writes proceed in parallel (file writes and copies release the GIL). No writers runs
    the bare forward (same hooks, concatenation and finiteness check, no host copy, no store).
    """
    device = next(model.parameters()).device
    base, _, _ = decoder_parts(model)
    queues = [queue.Queue(maxsize=max(1, queue_batches // max(1, len(writers)))) for _ in writers]
    failure: list[BaseException] = []
    refused: Counter = Counter()

    def write_loop(q: queue.Queue, writer: ShardWriter | ProcessWriter) -> None:
        item = ...
        try:
            while (item := q.get()) is not None:
                event, batch, hid, last, ok = item
                if event is not None:
                    event.synchronize()
                if isinstance(batch, _Item):  # its states already sit in the writer's ring slot
                    batch.ok = ok.tolist()
                    writer.submit(batch)
                    continue
                for j, r in enumerate(batch):
                    if not ok[j]:
                        refused["NaN/Inf in hidden state"] += 1
                        continue
                    n = len(r.input_ids)
                    writer.add(r.sample_id, input_ids=r.input_ids, loss_mask=r.loss_mask, hidden=hid[j, :n],
                               last_hidden=last[j, :n] if last is not None else None)
            writer.close()
            if isinstance(writer, ProcessWriter):
                refused["NaN/Inf in hidden state"] += writer.refused
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(e)
            while item is not None and (item := q.get()) is not None:  # drain: the producer must never block
                pass

    threads = [threading.Thread(target=write_loop, args=(q, w), name=f"store-writer-{w.writer_id}", daemon=True)
               for q, w in zip(queues, writers)]
    for t in threads:
        t.start()
    try:
        with capture(model, layer_ids) as taps, torch.inference_mode():
            for i, batch in enumerate(batches):
                if failure:
                    break
                ids, att = _pad(batch, device)
                out = base(input_ids=ids, attention_mask=att, use_cache=False)
                hid = torch.cat([taps[lid] for lid in layer_ids], dim=-1).to(torch.bfloat16)  # [B, T, K*H]
                last = out.last_hidden_state.to(torch.bfloat16) if last_hidden else None  # [B, T, H]
                bad = ~torch.isfinite(hid).all(-1)
                if last is not None:
                    bad |= ~torch.isfinite(last).all(-1)
                ok = ~(bad & att.bool()).any(-1)  # [B]
                if not writers:
                    refused["NaN/Inf in hidden state"] += int((~ok).sum())  # syncs, like the copy would
                elif isinstance(writers[i % len(writers)], ProcessWriter):
                    pw = writers[i % len(writers)]
                    slot = pw.slot()
                    b, t, width = hid.shape
                    pw.ring_hid[slot][: b * t * width].view(b, t, width).copy_(hid, non_blocking=True)
                    if last is not None:
                        pw.ring_last[slot][: b * t * last.shape[-1]].view(b, t, -1).copy_(last, non_blocking=True)
                    ok = ok.to("cpu", non_blocking=True)
                    event = None
                    if device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record()
                    item = _Item(slot=slot, sample_ids=[r.sample_id for r in batch], lengths=[len(r.input_ids) for r in batch],
                                 input_ids=[r.input_ids for r in batch], loss_masks=[r.loss_mask for r in batch],
                                 ok=[], seq=t)
                    queues[i % len(queues)].put((event, item, None, None, ok))
                else:
                    event = None
                    if device.type == "cuda":
                        hid, ok = hid.to("cpu", non_blocking=True), ok.to("cpu", non_blocking=True)
                        last = last.to("cpu", non_blocking=True) if last is not None else None
                        event = torch.cuda.Event()
                        event.record()
                    queues[i % len(queues)].put((event, batch, hid, last, ok))
                on_batch(sum(len(r.input_ids) for r in batch))
    finally:
        for q in queues:
            q.put(None)
        for t in threads:
            t.join()
    if failure:
        raise failure[0]
    return refused
