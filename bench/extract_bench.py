"""Extraction rate with the store vs the bare forward, same model, same batches, one run.

    python -m bench extract --store /dev/shm/xb.zarr --shape qwen3-8b --batches 20 --batch 8 --seq 2048
    python -m bench extract ... --dtype fp8_e4m3 --variants thread:3 --profile 4   # + where the time goes

Random-weight target built from a config (no download), bf16 on GPU. "bare" runs the decoder
stack with the same hooks, concatenation and finiteness check; "store" adds the host copies, the
writers and the zarr store (extract.pipeline.run_batches, exactly what `python -m extract`
runs). Prints one JSON line per variant. --profile N then runs N more batches of the first variant
under torch.profiler and prints its top ops by device time (CPU time without a GPU), to attribute a
ratio below 100% (e.g. the fp8 quantization kernels beside the forwards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch

from bench.common import SHAPES, random_target, synthetic_manifest
from cache_format import ShardWriter, create_store, finalize_store
from cache_format.schema import default_rows_per_shard
from extract.pipeline import compile_decoder, ring_fields, run_batches
from extract.plan import dflash_layer_ids
from extract.rendering import Rendered
from extract.ring import HostRing
from extract.writer_process import ProcessWriter


def main() -> None:
    ap = argparse.ArgumentParser()
    a = _args(ap)
    if a.sdpa == "auto":
        return measure(a)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[a.sdpa]
    with sdpa_kernel([backend]):
        measure(a)


def _args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    ap.add_argument("--store", default="/dev/shm/draftcache_extract_bench.zarr")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--last-hidden", action="store_true")
    ap.add_argument("--dtype", choices=["bfloat16", "fp8_e4m3", "mxfp4"], default="bfloat16")
    ap.add_argument("--queue-batches", type=int, default=4)
    ap.add_argument("--variants", default="thread:2",
                    help="comma-separated writer:count runs after one bare run, e.g. thread:1,thread:2,process:2; "
                    "writer:count:inline quantizes on the compute stream instead of the copy's side stream")
    ap.add_argument("--profile", type=int, default=0, help="profile this many store batches; print the top ops")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (extract --compile)")
    ap.add_argument("--sdpa", default="auto", choices=["auto", "flash", "efficient", "cudnn", "math"],
                    help="the scaled-dot-product attention backend every run is held to (auto: torch's choice)")
    ap.add_argument("--full-stack", action="store_true",
                    help="also time the bare forward through every layer (what ran before the stack stopped at the "
                    "last tap when the final hidden state is not stored)")
    return ap.parse_args()


def measure(a: argparse.Namespace) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_target(a.shape, dev)
    if a.compile:
        compile_decoder(model)
    layer_ids = dflash_layer_ids(model.config.num_hidden_layers, 5)
    g = torch.Generator().manual_seed(0)
    batches = [[Rendered(b * a.batch + j, torch.randint(0, model.config.vocab_size, (a.seq,), generator=g),
                         torch.ones(a.seq, dtype=torch.uint8), False, b * a.batch + j) for j in range(a.batch)]
               for b in range(a.batches + a.warmup)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    run_batches(model, layer_ids, batches[: a.warmup], [], None, last_hidden=a.last_hidden)
    sync()
    tokens = a.batches * a.batch * a.seq
    t0 = time.perf_counter()
    run_batches(model, layer_ids, batches[a.warmup:], [], None, last_hidden=a.last_hidden)
    sync()
    bare = tokens / (time.perf_counter() - t0)
    full = None
    if a.full_stack:
        t0 = time.perf_counter()
        run_batches(model, layer_ids, batches[a.warmup:], [], None, last_hidden=a.last_hidden, stop_at_last_tap=False)
        sync()
        full = tokens / (time.perf_counter() - t0)
    for variant in a.variants.split(","):
        writer, n, beside = _variant(variant)
        with_store, bytes_tok = run_store(a, model, layer_ids, batches[a.warmup:], writer, n, dev, tokens,
                                          beside=beside)
        print(json.dumps({"shape": a.shape, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                          "compile": a.compile, "sdpa": a.sdpa,
                          "batch": a.batch, "seq": a.seq, "writer": writer, "writers": n, "dtype": a.dtype,
                          "quantize": "beside" if beside else "inline", "slots": a.queue_batches,
                          "batches": a.batches, "layer_ids": layer_ids,
                          "bare_tok_s": bare, "bare_full_stack_tok_s": full, "store_tok_s": with_store,
                          "ratio": with_store / bare,
                          "store_write_gbps": with_store * bytes_tok / 1e9, "bytes_per_token": bytes_tok}), flush=True)
    if a.profile:
        profile_store(a, model, layer_ids, batches[a.warmup: a.warmup + a.profile], a.variants.split(",")[0], dev)


def _variant(spec: str) -> tuple[str, int, bool]:
    """"writer:count[:inline]" -> (writer, count, quantize beside the forward on the copy's stream)."""
    writer, n, *how = spec.split(":")
    return writer, int(n), how != ["inline"]


def profile_store(a, model, layer_ids, batches, variant: str, dev: torch.device) -> None:
    """The store run of `variant` over `batches` under torch.profiler: the top ops by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    writer, n, beside = _variant(variant)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        run_store(a, model, layer_ids, batches, writer, n, dev, sum(len(b) for b in batches) * a.seq, beside=beside)
    wall_ms = (time.perf_counter() - t0) * 1e3  # includes the store's setup, so busy is a lower bound
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=20, max_name_column_width=60), flush=True)
    # the device's kernels (copies apart: they run beside compute on the side stream) over the wall;
    # well below 1 means the device waits on the host
    kernels = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels if "memcpy" not in e.name.lower()) / 1e3
    copy_ms = sum(e.time_range.elapsed_us() for e in kernels if "memcpy" in e.name.lower()) / 1e3
    print(f"profiled wall {wall_ms:.1f} ms: kernels {busy_ms:.1f} ms ({busy_ms / wall_ms:.1%}), "
          f"copies {copy_ms:.1f} ms", flush=True)
    for e in events:  # our named ranges, also when they are not among the top rows
        if e.key.startswith("draftcache."):
            dev_ms = getattr(e, "device_time_total", 0.0) / 1e3
            print(f"range {e.key}: {e.count} calls, device {dev_ms:.3f} ms, cpu {e.cpu_time_total / 1e3:.3f} ms "
                  f"({dev_ms / max(len(batches), 1):.3f} ms device per batch)", flush=True)


def run_store(a, model, layer_ids, batches, writer: str, n: int, dev: torch.device, tokens: int,
              beside: bool = True) -> tuple[float, int]:
    """Tokens/s of the same batches with `n` writers of kind `writer` into a fresh store (beside: the
    quantization on the copy's side stream)."""
    h, n_layers = model.config.hidden_size, model.config.num_hidden_layers
    shutil.rmtree(a.store, ignore_errors=True)
    m = synthetic_manifest(name=f"random-{a.shape}", hidden_size=h, vocab_size=model.config.vocab_size,
                           layer_ids=tuple(layer_ids), num_layers=n_layers, last_hidden=a.last_hidden,
                           num_records=len(batches) * a.batch, max_len=a.seq, bucket_bounds=(a.seq,), dtype=a.dtype,
                           rows_per_shard=default_rows_per_shard(h, 5))
    create_store(a.store, m)
    # The ring and the writers are set up once per run (page-locking the ring takes a moment), so
    # they are made before the clock starts; everything per batch is timed, including the tail:
    # the clock stops when the last shard is committed.
    quant = "" if a.dtype == "bfloat16" else a.dtype
    ring = HostRing(a.queue_batches, a.batch * a.seq, ring_fields(h * 5, 5, h if a.last_hidden else 0, quant),
                    pin=dev.type == "cuda", shared=writer == "process")
    ws = ([ProcessWriter(a.store, w, ring) for w in range(n)] if writer == "process"
          else [ShardWriter(a.store, writer_id=w) for w in range(n)])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    refused = run_batches(model, layer_ids, batches, ws, ring, last_hidden=a.last_hidden, quant=quant,
                          quant_beside=beside)
    sync()
    rate = tokens / (time.perf_counter() - t0)
    ring.close()
    state = finalize_store(a.store, m)
    shutil.rmtree(a.store, ignore_errors=True)
    expected = sum(len(b) for b in batches)
    if state["num_samples"] != expected or sum(refused.values()):  # a rate is only valid if everything was written
        raise SystemExit(f"{writer}:{n}: wrote {state['num_samples']} of {expected} samples ({dict(refused)})")
    return rate, m.bytes_per_token()


if __name__ == "__main__":
    main()
