"""`python -m cache_format {inspect,verify,show,plot} STORE ...`: look at a store without writing
it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from cache_format.audit import inspect_store, sample_norms, verify_store
from cache_format.errors import CacheFormatError, brief
from cache_format.reader import StoreReader


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


@click.group()
def cli() -> None:
    """Inspect, verify and look inside a draftcache store."""


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(store: str, as_json: bool) -> None:
    """Manifest summary, buckets, shards, bytes per token and compression."""
    try:
        info = inspect_store(store)
    except (CacheFormatError, KeyError) as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    m = info["manifest"]
    click.echo(f"store        {info['path']}  (format {info['format_version']}, "
               f"{'finalized' if info['finalized'] else 'NOT finalized'})")
    click.echo(f"target       {m['target']['name']}  N={m['target']['num_layers']} "
               f"H={m['hidden_size']} V={m['target']['vocab_size']}")
    click.echo(f"layers       {m['layer_ids']}  last_hidden={m['last_hidden']}  dtype={m['dtype']} "
               f" compression={m['compression']}")
    click.echo(f"mask token   {m['mask_token_id']} "
               f"{m['mask_token'] or '(a vocabulary padding row)'}")
    kept = (m.get("extract_config") or {}).get("keep_layers")
    if kept:
        click.echo(f"kept layers  {kept}  (their weights, for train --init-layers)")
    prompts = "" if info["num_prompts"] is None else f"  prompts {info['num_prompts']:,}"
    click.echo(f"samples      {info['num_samples']:,}  tokens {info['num_tokens']:,}{prompts}")
    click.echo(f"bytes/token  {info['bytes_per_token']:,.0f} on disk, "
               f"{info['logical_bytes_per_token']:,} logical (ratio "
               f"{info['compression_ratio']:.3f})  disk {info['disk_bytes'] / 2**20:,.1f} MiB")
    if info["quant_relative_rms_error"] is not None:
        click.echo(f"{info['manifest']['dtype']} error relative RMS "
                   f"{info['quant_relative_rms_error']:.4f}")
    click.echo(f"shards       {info['shards']['complete']} complete, "
               f"{info['shards']['incomplete']} incomplete (tail)")
    click.echo("bucket  tokens          samples      tokens")
    for b in info["buckets"]:
        click.echo(f"  {b['bucket']:>2}  {b['lo']:>6}-{b['hi']:<7} {b['num_samples']:>8,} "
                   f"{b['num_tokens']:>11,}")


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def verify(store: str, as_json: bool) -> None:
    """Recompute every checksum; exit 0 when sound, 1 otherwise (naming each bad shard)."""
    try:
        res = verify_store(store)
    except (CacheFormatError, KeyError) as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        for b in res["bad_shards"]:
            click.echo(f"BAD {b['shard']}: {b['reason']}")
        for b in res["bad_files"]:
            click.echo(f"BAD {Path(store) / b['file']}: {b['reason']}")
        if res["duplicate_sample_ids"]:
            click.echo(f"duplicate sample ids: {res['duplicate_sample_ids'][:20]}")
        click.echo(f"{'OK' if res['ok'] else 'FAILED'}: {res['num_samples']} samples, "
                   f"{res['num_shards']} shards checked")
        if not res.get("finalized", True):
            click.echo("NOT FINALIZED: stage one is still writing or was stopped; the committed "
                       "samples were checked, and training needs --follow or a rerun of the "
                       "extraction to finish it")
    sys.exit(0 if res["ok"] else 1)


@cli.command()
@click.argument("store", type=click.Path())
@click.argument("sample_id", type=int)
def show(store: str, sample_id: int) -> None:
    """Decoded text with supervised spans in [[...]], length, bucket, per-layer norms."""
    try:
        r = StoreReader(store)
        s = r.get(sample_id)
    except (CacheFormatError, KeyError) as e:
        _fail(e)
    ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
    tok_dir = Path(store) / "tokenizer"
    decode = None
    if tok_dir.is_dir():
        from transformers import AutoTokenizer

        try:
            decode = AutoTokenizer.from_pretrained(str(tok_dir)).decode
        except Exception as e:  # noqa: BLE001 - tokenizers raise many types on a damaged file
            _fail(CacheFormatError(f"{tok_dir}: damaged tokenizer ({brief(e)})"))
    spans, cur, cur_m = [], [], mask[0] if mask else 0
    for t, mk in zip(ids, mask):
        if mk != cur_m:
            spans.append((cur_m, cur))
            cur, cur_m = [], mk
        cur.append(t)
    spans.append((cur_m, cur))
    text = "".join((f"[[{decode(t) if decode else t}]]" if mk
                    else (decode(t) if decode else str(t)))
                   for mk, t in spans if t)
    lo, hi = r.manifest.bucket_range(s.bucket)
    click.echo(f"sample {sample_id}: {len(ids)} tokens, {sum(mask)} supervised, bucket {s.bucket} "
               f"({lo}-{hi})")
    norms = sample_norms(s.hidden, len(r.manifest.layer_ids))
    click.echo("layer norms  " + "  ".join(f"L{lid}={n:.2f}"
                                           for lid, n in zip(r.manifest.layer_ids, norms)))
    if s.last_hidden is not None:
        click.echo(f"last_hidden  norm={s.last_hidden.float().norm(dim=-1).mean():.2f}")
    click.echo("-" * 60)
    click.echo(text)


@cli.command()
@click.argument("store", type=click.Path())
@click.argument("out", type=click.Path())
def plot(store: str, out: str) -> None:
    """Histogram of sample lengths, coloured by bucket, into OUT.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        r = StoreReader(store)
    except CacheFormatError as e:
        _fail(e)
    lengths, buckets = r.lengths(), r.buckets()
    fig, ax = plt.subplots(figsize=(8, 4))
    for b in range(r.manifest.num_buckets):
        lo, hi = r.manifest.bucket_range(b)
        sel = lengths[buckets == b]
        if len(sel):
            ax.hist(sel, bins=40, range=(0, r.manifest.max_len), alpha=0.7,
                    label=f"bucket {b} ({lo}-{hi}): {len(sel)}")
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"{Path(store).name}: {len(r)} samples, {int(lengths.sum()):,} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:  # a missing or read-only directory
        _fail(CacheFormatError(f"{out}: cannot write the plot ({e.strerror or e})"))
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    cli()
