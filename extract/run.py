"""Stage one, per rank: render data, run the target's decoder stack, write taps into the store.

One process per GPU under torchrun (or one plain process). Rank 0 creates (or checks) the store;
every rank writes its own shards through writers behind a bounded host ring, so the forward
loop never waits on the disk; rank 0 finalizes once every rank has closed its writer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from cache_format import (
    DatasetInfo,
    Manifest,
    ShardWriter,
    create_store,
    finalize_store,
    write_frozen,
    write_prompt_keys,
)
from cache_format.audit import inspect_store
from cache_format.checksums import record_checksums, sha256_file
from cache_format.codec import QUANTIZED
from cache_format.index import LogFollower
from cache_format.lock import WriterLock
from cache_format.mirror import writing_to
from cache_format.remote import default_local, is_url
from cache_format.schema import check_layer_ids, default_bucket_bounds, default_rows_per_shard
from extract.config import ExtractConfig
from extract.pipeline import compile_decoder, ring_fields, run_batches
from extract.plan import dflash_layer_ids, partition, token_budget_batches
from extract.regenerate.answers import regenerate
from extract.rendering import BadRecord, Rendered, read_conversations, render_many
from extract.ring import HostRing
from extract.writer_process import ProcessWriter
from runtime.preemption import Preemption
from runtime.world import World, any_rank
from target.loader import frozen_parts, load_target, mask_token_of, packaged_gguf, target_sha256

__all__ = ["run"]

DEFAULT_DATA_DIR = "data"
DEFAULT_MAX_NEW_TOKENS = 96


def default_data_path(cfg: ExtractConfig) -> Path:
    """Where the default data for `cfg` lives: named by a hash of everything that decides it (the
    target file's sha256, the prompt limit, the seed, the generation settings), so another target,
    limit or seed never reuses these answers."""
    ident = {"target_sha256": target_sha256(cfg.target or packaged_gguf()),
             "limit": cfg.limit or 64,
             "seed": cfg.seed, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "temperature": 0.0,
             "prompts": "packaged training prompts"}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return Path(DEFAULT_DATA_DIR) / f"default-{key}.jsonl"


def _default_data(cfg: ExtractConfig, world: World) -> str:
    """The packaged prompts with target-generated responses (rank 0 generates once per identity)."""
    path = default_data_path(cfg)
    if not path.exists() and world.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        # two extractions at once: one builds, the other waits for it and then reads what it built
        with WriterLock(path, what="default data").acquire(wait=True):
            if not path.exists():
                tmp = path.with_suffix(".partial")
                regenerate(out=str(tmp), target=cfg.target, limit=cfg.limit or 64,
                           max_new_tokens=DEFAULT_MAX_NEW_TOKENS, seed=cfg.seed)
                os.replace(tmp, path)
    world.barrier()
    return str(path)


def _check_template_options(cfg: ExtractConfig, data: str) -> None:
    """Refuse, in one line, to render data made with other chat-template options than these: answers
    regenerated in one mode (thinking, say) rendered in another teach the drafter what is never
    served. The regeneration's summary (DATA.summary.json) says which options made the data."""
    summary = Path(str(data) + ".summary.json")
    if not summary.is_file():
        return
    try:
        made = json.loads(summary.read_text()).get("chat_template_kwargs", {})
    except (ValueError, OSError, AttributeError) as e:
        raise ValueError(
            f"{summary}: unreadable ({type(e).__name__}); remove it or repair it") from None
    if made != cfg.template_kwargs:
        raise ValueError(f"{data} was regenerated with chat template options {json.dumps(made)} "
                         f"({summary}), not {json.dumps(cfg.template_kwargs)}: pass "
                         f"--chat-template-kwargs '{json.dumps(made)}'")


def _render_all(cfg: ExtractConfig, data: str, tokenizer, skipped: Counter,
                world: World) -> list[Rendered]:
    bad: list[str] = []
    out = []
    _check_template_options(cfg, data)
    records = list(read_conversations(data, skip_bad=cfg.skip_bad, limit=cfg.limit, bad=bad))
    # the ranks of one host share its cores; one core per rank stays with the target's process
    per_rank = (os.cpu_count() or 1) // max(1, world.local_world_size)
    processes = min(8, per_rank - 1)
    for (sid, _), r in zip(records,
                           render_many(records, tokenizer, max_len=cfg.max_len, processes=processes,
                                                             template_kwargs=cfg.template_kwargs)):
        if isinstance(r, BadRecord):
            raise BadRecord(f"{data}:{sid + 1}: {r}")
        if r.truncated and cfg.drop_long:
            skipped["too long"] += 1
        elif int(r.loss_mask.sum()) < cfg.min_supervised:
            skipped[f"< {cfg.min_supervised} supervised tokens"] += 1
        else:
            out.append(r)
    if bad:
        skipped["malformed"] += len(bad)
    return out


def run(cfg: ExtractConfig, *, world: World | None = None, on_ready=None,
        preemptible: bool = False) -> dict:
    """Extract `cfg.data` into `cfg.store`; returns the closing summary (rank 0's is complete).
    on_ready: called on rank 0 once the store is created or checked for a resume (a mirror may
    push). preemptible: SIGTERM or SIGINT during the forward loop stop it after the batch in hand;
    what was handed to the writers is committed and the summary is {"stopped_by_signal": N, ...} (a
    rerun goes on)."""
    world = world or World.from_env()
    if is_url(cfg.store):
        return _run_to_url(cfg, world, preemptible)
    device = world.join()
    t0 = time.time()
    # one writing run per store: refused at once, before the target loads (cache_format/lock.py)
    lock = WriterLock(cfg.store, world.rank)
    if world.rank == 0:
        lock.acquire()
    world.barrier()
    if world.rank != 0:
        lock.acquire()
    try:
        return _run_locked(cfg, world, device, t0, on_ready, preemptible)
    finally:
        lock.release()


def _run_to_url(cfg: ExtractConfig, world: World, preemptible: bool = False) -> dict:
    """A store on object storage: written locally in the stage directory as always, mirrored up by
    rank 0 (cache_format.mirror.writing_to: lease, resume from the server, commit-ordered pushes).
    The other ranks write into the same stage directory: one node."""
    stage = Path(cfg.stage_dir) if cfg.stage_dir else default_local(cfg.store)
    local = dataclasses.replace(cfg, store=str(stage), stage_dir="")
    if world.rank != 0:  # they wait at run's first barrier for rank 0's lease and download
        return run(local, world=world, preemptible=preemptible)
    with writing_to(cfg.store, stage, ttl=cfg.lease_ttl, overwrite=cfg.overwrite) as mirror:
        # pushes once checked
        summary = run(local, world=world, on_ready=mirror.arm, preemptible=preemptible)
    if not summary:
        return summary
    if "stopped_by_signal" in summary:  # named by its URL, not the stage directory
        return {**summary, "store": cfg.store}
    # the stage no longer holds the complete shards: the server's figures
    info = inspect_store(cfg.store)
    return {**summary, "store": cfg.store, "stage_dir": str(stage),
            "bytes_per_token": info["bytes_per_token"], "store_bytes": info["disk_bytes"]}


def _create(cfg: ExtractConfig, world: World, target, layer_ids: list[int], samples: list[Rendered],
            data) -> Manifest:
    """The store's manifest; rank 0 creates the store (or checks it for a resume) with the frozen
    target parts, prompt keys and tokenizer, while the other ranks wait."""
    h = target.info.hidden_size
    rows_per_shard = cfg.rows_per_shard or default_rows_per_shard(h, len(layer_ids))
    mask_id, mask_text = mask_token_of(target.tokenizer, target.info.vocab_size)
    manifest = Manifest(
        target=target.info, tokenizer_sha256=target.tokenizer_sha256, layer_ids=tuple(layer_ids),
        mask_token_id=mask_id, mask_token=mask_text,
        last_hidden=cfg.last_hidden, dataset=DatasetInfo(path=str(data), sha256=sha256_file(data),
                                                         num_records=len(samples)),
        max_len=cfg.max_len, bucket_bounds=default_bucket_bounds(cfg.max_len), dtype=cfg.dtype,
        compression=cfg.compression, rows_per_shard=rows_per_shard,
        rows_per_chunk=min(32, rows_per_shard), extract_config=cfg.to_dict(),
    )
    if world.rank == 0:
        # a bad layer id is refused before the store exists
        frozen = frozen_parts(target.model, cfg.keep_layers)
        create_store(cfg.store, manifest, overwrite=cfg.overwrite)
        write_frozen(cfg.store, frozen)
        write_prompt_keys(cfg.store, [r.sample_id for r in samples],
                          [r.prompt_key for r in samples])
        if not (Path(cfg.store) / "tokenizer").exists():
            target.tokenizer.save_pretrained(str(Path(cfg.store) / "tokenizer"))
        record_checksums(cfg.store, manifest, finalized=False)  # the files just written
    world.barrier()
    return manifest


def _finalize(cfg: ExtractConfig, world: World, manifest: Manifest, mine_stats: dict,
              skipped: Counter, *,
              data, already_committed: int, layer_ids: list[int], t0: float) -> dict:
    """Every rank's counts gathered; rank 0 finalizes the store and returns the closing summary."""
    stats = [mine_stats]
    if world.world_size > 1:
        stats = [None] * world.world_size
        dist.all_gather_object(stats, mine_stats)
    summary: dict = {}
    if world.rank == 0:
        for s in stats:
            skipped.update(s["nonfinite"])
        state = finalize_store(cfg.store, manifest)
        info = inspect_store(cfg.store)
        summary = {
            "store": cfg.store, "data": str(data),
            "samples_written_now": sum(s["written"] for s in stats),
            "samples_in_store": state["num_samples"], "already_committed": already_committed,
            "skipped": dict(skipped), "tokens_now": sum(s["tokens"] for s in stats),
            "tokens_per_s_per_rank": [s["tokens"] / s["seconds"] if s["seconds"] else 0.0
                                      for s in stats],
            "bytes_per_token": info["bytes_per_token"], "store_bytes": info["disk_bytes"],
            "buckets": {f"{b['lo']}-{b['hi']}": b["num_samples"] for b in info["buckets"]},
            "layer_ids": layer_ids, "wall_s": time.time() - t0,
        }
    return summary


def _check_data_file(path: str) -> None:
    """Cheap checks of --data before the target loads (which takes up to minutes)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such data file")
    with open(p, "rb") as f:
        if not any(line.strip() for line in f):
            raise ValueError(f"{path}: the data file holds no records")


def _run_locked(cfg: ExtractConfig, world: World, device: torch.device, t0: float, on_ready=None,
                preemptible: bool = False) -> dict:
    # a signal from here on stops the run at its next boundary with what it has committed (none
    # while the target loads or the data renders); one during finalizing lets it finish: the store
    # is then whole
    with Preemption(enabled=preemptible) as preempt:
        return _extract(cfg, world, device, t0, on_ready, preempt)


def _extract(cfg: ExtractConfig, world: World, device: torch.device, t0: float, on_ready,
             preempt: Preemption) -> dict:
    if cfg.data:
        _check_data_file(cfg.data)
    # ------------------------------------------------------------------ target and data
    target = load_target(cfg.target, device=device)
    if cfg.compile:
        compile_decoder(target.model)
    n_layers = target.info.num_layers
    layer_ids = list(cfg.layers) or dflash_layer_ids(n_layers, cfg.num_taps)
    check_layer_ids(layer_ids, n_layers, target.info.name)
    data = cfg.data or _default_data(cfg, world)
    skipped: Counter = Counter()
    samples = _render_all(cfg, data, target.tokenizer, skipped, world)
    if not samples:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "none rendered"
        raise ValueError(f"{data}: no usable samples ({why})")
    if any_rank(preempt.requested(), device, world.world_size):  # nothing written yet
        return {"stopped_by_signal": preempt.signum or signal.SIGTERM, "store": cfg.store,
                "already_committed": 0}
    by_id = {r.sample_id: r for r in samples}

    # ------------------------------------------------------------------ the store
    manifest = _create(cfg, world, target, layer_ids, samples, data)
    if on_ready is not None and world.rank == 0:
        on_ready()
    follower = LogFollower(Path(cfg.store))
    follower.poll()  # committed by any writer id: a resume with another world size skips them too
    committed = set(follower.index.sample_ids.tolist())
    todo = [r.sample_id for r in samples if r.sample_id not in committed]
    mine = partition(todo, [len(by_id[s].input_ids) for s in todo], world.world_size, world.rank)
    my_samples = [by_id[s] for s in mine]
    nonfinite, elapsed = _forward_all(cfg, world, device, target, layer_ids, my_samples,
                                      stop=preempt.requested)
    if preempt.requested():  # the batches handed to the writers are committed; a rerun goes on
        return {"stopped_by_signal": preempt.signum, "store": cfg.store,
                "already_committed": len(committed)}

    # ------------------------------------------------------------------ finalize and report
    tokens = sum(len(by_id[s].input_ids) for s in mine)
    mine_stats = {"tokens": tokens, "seconds": elapsed,
                  "written": len(mine) - sum(nonfinite.values()), "nonfinite": dict(nonfinite)}
    summary = _finalize(cfg, world, manifest, mine_stats, skipped, data=data,
                        already_committed=len(committed), layer_ids=layer_ids, t0=t0)
    world.barrier()
    return summary


def _forward_all(cfg: ExtractConfig, world: World, device: torch.device, target,
                 layer_ids: list[int], mine: list[Rendered], *, stop) -> tuple[Counter, float]:
    """This rank's samples through the target into the store's writers: (refused counts,
    seconds)."""
    h = target.info.hidden_size
    quant = cfg.dtype if cfg.dtype in QUANTIZED else ""
    ring = HostRing(cfg.queue_batches, cfg.token_budget,
                    ring_fields(h * len(layer_ids), len(layer_ids), h if cfg.last_hidden else 0,
                                quant),
                    pin=device.type == "cuda", shared=cfg.writer == "process")
    ids = [world.rank * cfg.writers + w for w in range(cfg.writers)]
    writers = ([ProcessWriter(cfg.store, i, ring) for i in ids] if cfg.writer == "process"
               else [ShardWriter(cfg.store, writer_id=i) for i in ids])
    by_id = {r.sample_id: r for r in mine}
    batches = token_budget_batches(list(by_id), [len(r.input_ids) for r in mine], cfg.token_budget)
    # Host RAM for the ring is queue_batches x token_budget x bytes_per_token (e.g. 4 x 16384 x
    # 40 KiB = 2.6 GB for Qwen3-8B with 5 taps), plus one shard buffer per bucket and writer, and
    # one more per writer for the shard its I/O thread is writing.
    bar = tqdm(total=sum(len(r.input_ids) for r in mine), unit="tok", disable=world.rank != 0,
               desc=f"extract x{world.world_size}")
    t_loop = time.time()
    try:
        nonfinite = run_batches(target.model, layer_ids, [[by_id[s] for s in b] for b in batches],
                                writers, ring, last_hidden=cfg.last_hidden, quant=quant,
                                on_batch=bar.update, stop=stop)
    finally:
        bar.close()
        ring.close()
    return nonfinite, time.time() - t_loop
