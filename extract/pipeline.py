"""The forward -> host -> store pipeline of one rank, shared by `extract.run` and the benchmark.

The GPU thread (the caller) runs the decoder stack with hooks and copies each batch's states into
a free slot of a host ring (extract/ring.py) on a side stream, so the copy overlaps the next
forward. Each batch's samples are dealt over the rank's writers (sample j of batch i to writer
(i + j) % W), so the writers share every batch and the tail after the last forward is short. Each
writer is a thread that either feeds a ShardWriter itself or drives a writer process; the last one
done with a slot gives it back. The ring is bounded, so host RAM is bounded and a slow disk slows
the GPU rather than exhausting memory.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from cache_format import ShardWriter
from cache_format.codec import quantize, scale_layout
from extract.rendering import Rendered
from extract.ring import HostRing
from extract.writer_process import ProcessWriter, WriteItem, write_rows
from target.loader import capture, decoder_parts, stack_upto

__all__ = ["ring_fields", "run_batches"]

NONFINITE = "NaN/Inf in hidden state"


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


def _finite_rows(hid: torch.Tensor, last: torch.Tensor | None, att: torch.Tensor) -> torch.Tensor:
    """bool [B]: the samples whose every real token's states (hid [B, T, K*H], last [B, T, H] or
    None) are finite; padding (att [B, T] == 0) does not count."""
    bad = ~torch.isfinite(hid).all(-1)  # [B, T]
    if last is not None:
        bad |= ~torch.isfinite(last).all(-1)
    return ~(bad & att.bool()).any(-1)


def _fields_on(stream, hid: torch.Tensor, last: torch.Tensor | None, ok: torch.Tensor,
              att: torch.Tensor, num_taps: int, quant: str):
    """_device_fields of a batch, computed on `stream` (the copy's side stream) or, with None, on
    the current one."""
    if stream is None:
        return _device_fields(hid, last, ok, att, num_taps, quant)
    stream.wait_stream(torch.cuda.current_stream())
    for x in (hid, ok, att) + ((last,) if last is not None else ()):
        x.record_stream(stream)  # read there: their memory must outlive the side stream's use
    with torch.cuda.stream(stream):
        return _device_fields(hid, last, ok, att, num_taps, quant)


def run_batches(model: torch.nn.Module, layer_ids: list[int], batches: Sequence[Sequence[Rendered]],
                writers: Sequence[ShardWriter | ProcessWriter], ring: HostRing | None, *,
                last_hidden: bool,
                quant: str = "", on_batch: Callable[[int], None] = lambda n: None,
                stop_at_last_tap: bool = True, quant_beside: bool = True,
                stop: Callable[[], bool] = lambda: False) -> Counter:
    """Extract every batch; returns counts of refused samples. Closes the writers. `stop()` true
    before a batch ends the loop there (preemption): the batches already handed to the writers are
    written.

    quant ("fp8_e4m3" or "mxfp4"; "" for bf16) quantizes the taps on the device (ring field "hidden"
    holds the bits, "hidden_scale" the scales), which halves the copy (fp8) or more and keeps the
    host free of float maths.
    On a GPU the quantization runs on the copy's side stream (quant_beside), so the next forward
    overlaps it as it overlaps the copy; quant_beside=False keeps it on the compute stream (to
    compare). No writers (and no ring) runs the bare forward: same hooks, concatenation and
    finiteness check, no host copy, no store. Without last_hidden the stack stops at the last tap
    (stop_at_last_tap=False runs every layer, as before; for comparisons).
    """
    device = next(model.parameters()).device
    base, _, _ = decoder_parts(model)
    io = _WriterThreads(writers, ring, quant)
    failure, refused = io.failure, io.refused
    copy_stream = torch.cuda.Stream() if device.type == "cuda" and writers else None
    try:
        # no layer above it runs
        upto = max(layer_ids) if stop_at_last_tap and not last_hidden else None
        with capture(model, layer_ids) as taps, stack_upto(model, upto), torch.inference_mode():
            for i, batch in enumerate(batches):
                if failure or stop():
                    break
                ids, att = _pad(batch, device)
                out = base(input_ids=ids, attention_mask=att, use_cache=False)
                # [B, T, K*H]
                hid = torch.cat([taps[lid] for lid in layer_ids], dim=-1).to(torch.bfloat16)
                # [B, T, H]
                last = out.last_hidden_state.to(torch.bfloat16) if last_hidden else None
                ok = _finite_rows(hid, last, att)  # [B]
                if not writers:
                    refused[NONFINITE] += int((~ok).sum())  # syncs, like the copy would
                    on_batch(sum(len(r.input_ids) for r in batch))
                    continue
                beside = bool(quant) and quant_beside and copy_stream is not None
                fields, small = _fields_on(copy_stream if beside else None, hid, last, ok, att,
                                           len(layer_ids), quant)
                slot = ring.take(failed=lambda: bool(failure))
                if slot is None:
                    break
                b, t, _ = hid.shape
                event, small = _to_host(fields, small, ring.views(slot, b, t), copy_stream)
                parts = _deal(b, i, len(writers))
                ring.hold(slot, len(parts))
                for k, rows in parts:
                    io.inboxes[k].put((event, slot, b, t, rows, batch, small))
                on_batch(sum(len(r.input_ids) for r in batch))
    finally:
        io.close()
    if failure:
        raise failure[0]
    return refused


class _WriterThreads:
    """One I/O thread per store writer, fed batches (their ring slot and rows) through its inbox; no
    GPU work runs on them. A writer's error stops the feeding (`failure`, re-raised by the caller)
    and its inbox is drained so that every ring slot is given back; `refused` counts the samples
    the writers refused as non-finite."""

    def __init__(self, writers: Sequence[ShardWriter | ProcessWriter], ring: HostRing | None,
                 quant: str) -> None:
        self.ring, self.quant = ring, quant
        # bounded by the ring's slots
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in writers]
        self.failure: list[BaseException] = []
        self.refused: Counter = Counter()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(q, w),
                                         name=f"store-writer-{w.writer_id}", daemon=True)
                        for q, w in zip(self.inboxes, writers)]
        for t in self.threads:
            t.start()

    def _loop(self, inbox: queue.Queue, writer: ShardWriter | ProcessWriter) -> None:
        ring, quant, item = self.ring, self.quant, ...
        try:
            while (item := inbox.get()) is not None:
                event, slot, b, t, rows, batch, small = item
                if event is not None:
                    event.synchronize()  # the states and `small` have landed in host memory
                w = WriteItem(slot=slot, batch=b, seq=t, rows=rows,
                              sample_ids=[batch[j].sample_id for j in rows],
                              input_ids=[batch[j].input_ids for j in rows],
                              loss_masks=[batch[j].loss_mask for j in rows],
                              ok=[bool(small[j, 0]) for j in rows],
                              quant_sq=[(float(small[j, 1]), float(small[j, 2]))
                                        for j in rows] if quant else None)
                if isinstance(writer, ProcessWriter):
                    n = writer.write(w)
                else:
                    n = write_rows(writer, ring.views(slot, b, t), w)
                with self._lock:
                    self.refused[NONFINITE] += n
                ring.release(w.slot)
            writer.close()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.failure.append(e)
            # drain: give every slot back
            while item is not None and (item := inbox.get()) is not None:
                ring.release(item[1])

    def close(self) -> None:
        """End of input: every thread finishes its inbox, closes its writer and is joined."""
        for q in self.inboxes:
            q.put(None)
        for t in self.threads:
            t.join()


def _to_host(fields: dict[str, torch.Tensor], small: torch.Tensor, host: dict[str, torch.Tensor],
             copy_stream) -> tuple[object | None, torch.Tensor]:
    """The batch's device fields into the ring slot's host views, and `small` to the host: on the
    side stream when there is one (the next forward overlaps the copy), with the event a writer
    waits on; else on the compute stream. Returns (event or None, small as the writers will read
    it)."""
    if copy_stream is None:
        for name, x in fields.items():
            host[name].copy_(x)
        return None, small
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        for name, x in fields.items():
            host[name].copy_(x, non_blocking=True)
        small_host = small.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    # Every tensor the side stream reads must outlive its copy: without this the allocator hands
    # their memory to the next forward while the copy is queued. (Forgetting the `ok` mask once
    # refused most samples of large batches as NaN/Inf.)
    for x in (*fields.values(), small):
        x.record_stream(copy_stream)
    return event, small_host


def _deal(rows: int, batch_index: int, writers: int) -> list[tuple[int, list[int]]]:
    """(writer, its rows) for one batch: row j to writer (batch_index + j) % writers, so successive
    batches start on successive writers; writers with no row left out."""
    parts: list[list[int]] = [[] for _ in range(writers)]
    for j in range(rows):
        parts[(batch_index + j) % writers].append(j)
    return [(k, r) for k, r in enumerate(parts) if r]


def _device_fields(hid: torch.Tensor, last: torch.Tensor | None, ok: torch.Tensor,
                   att: torch.Tensor,
                   num_taps: int, quant: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The ring fields of one batch, and per-sample `small` [B, 3]: ok, squared quantization error,
    squared ref.

    A quant dtype quantizes the K = num_taps taps here (cache_format.codec.quantize); the error sums
    cover real tokens only (att), as the host path's would.
    """
    small = torch.zeros(hid.shape[0], 3, dtype=torch.float64, device=hid.device)
    small[:, 0] = ok.double()
    fields = {"hidden": hid}
    if quant:
        # a named range, so a profile (python -m bench extract --profile) can price the quantization
        with torch.profiler.record_function(f"draftcache.quantize.{quant}"):
            # [B, T, bytes] u8, [B, T, scales], [B, T] f64 x2
            bits, scales, err, ref = quantize(hid, num_taps, quant)
            real = att.double()  # [B, T]
            small[:, 1] = (err * real).sum(-1)
            small[:, 2] = (ref * real).sum(-1)
        fields = {"hidden": bits, "hidden_scale": scales}
    if last is not None:
        fields["last_hidden"] = last
    return fields, small


def compile_decoder(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer's forward in place. The capture hooks run in the module call
    around it, outside the compiled graphs; dynamic shapes, since the token-budget plan gives
    batches of many sizes and lengths."""
    _, layers, _ = decoder_parts(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def ring_fields(width: int, num_taps: int, last_width: int,
                quant: str) -> dict[str, tuple[int, torch.dtype]]:
    """The HostRing fields that run_batches fills for these shapes (quant: "" for bf16, else the
    dtype)."""
    if not quant:
        fields = {"hidden": (width, torch.bfloat16)}
    else:
        nbytes, scales, scale_dtype = scale_layout(quant, num_taps, width // num_taps)
        fields = {"hidden": (nbytes, torch.uint8),
                  "hidden_scale": (scales, getattr(torch, scale_dtype))}
    if last_width:
        fields["last_hidden"] = (last_width, torch.bfloat16)
    return fields
