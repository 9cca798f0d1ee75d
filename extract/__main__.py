"""python -m extract: stage one. Target hidden states into a draftcache store.

    python -m extract --store stores/demo.zarr                       # packaged SmolLM2 + default data
    python -m extract --store /dev/shm/q8b.zarr --target /models/Qwen3-8B --data chats.jsonl
    torchrun --nproc-per-node 8 -m extract --store /dev/shm/q8b.zarr --target ... --data ...
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m extract ...  # shared FS

Rerunning the same command resumes; other settings are refused unless --overwrite.
"""

from __future__ import annotations

import json
import sys

import click

from extract.config import ExtractConfig


def _layers(_ctx, _param, value: str) -> tuple[int, ...]:
    from cache_format.schema import parse_layer_ids

    try:
        return parse_layer_ids(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings={"max_content_width": 100})
@click.option("--store", required=True, help="Output store directory (zarr v3); /dev/shm or NVMe.")
@click.option("--target", default="", help="HF causal-LM directory or .gguf file [default: packaged SmolLM2 GGUF].")
@click.option("--data", default="", help="JSONL conversations [default: packaged prompts + target responses].")
@click.option("--layers", default="", callback=_layers, help="Tapped layer ids, e.g. 1,9,17,25,33 [default: DFlash rule].")
@click.option("--num-taps", default=5, show_default=True, help="K for the default tap rule.")
@click.option("--last-hidden/--no-last-hidden", default=True, show_default=True,
              help="Also store the final (post-norm) hidden state.")
@click.option("--max-len", default=2048, show_default=True, help="Truncate samples to this many tokens.")
@click.option("--drop-long", is_flag=True, help="Skip samples longer than --max-len instead of truncating.")
@click.option("--min-supervised", default=32, show_default=True, help="Skip samples with fewer assistant tokens.")
@click.option("--dtype", type=click.Choice(["bfloat16", "fp8_e4m3"]), default="bfloat16", show_default=True)
@click.option("--compression", type=click.Choice(["none", "blosc-zstd1"]), default="none", show_default=True)
@click.option("--token-budget", default=16384, show_default=True, help="Padded tokens per forward batch.")
@click.option("--rows-per-shard", default=0, help="Tokens per shard [default: ~64 MiB of hidden states].")
@click.option("--queue-batches", default=4, show_default=True,
              help="Slots of the host ring that forward batches wait in for the writers. Host RAM for "
                   "the ring is queue_batches x token_budget x bytes/token (4 x 16384 x 40 KiB = 2.6 GB for Qwen3-8B, "
                   "5 taps), plus one shard buffer per length bucket and one more per writer (the shard being written).")
@click.option("--writer", type=click.Choice(["thread", "process"]), default="thread", show_default=True,
              help="Write the store from threads of the GPU process, or from writer processes that "
                   "read the ring from shared memory.")
@click.option("--writers", default=3, show_default=True,
              help="Store writers per rank; they share every batch and each writes whole shards of its own.")
@click.option("--skip-bad", is_flag=True, help="Count and skip malformed lines instead of stopping.")
@click.option("--overwrite", is_flag=True, help="Delete an existing store with other settings and start over.")
@click.option("--limit", default=0, help="Use only the first N records (0 = all).")
@click.option("--seed", default=0, help="Seed for default-data regeneration.")
@click.option("--json", "as_json", is_flag=True, help="Print the closing summary as JSON.")
def main(as_json: bool, **kw) -> None:
    """Extract target hidden states into a draftcache store (resumable)."""
    from cache_format import CacheFormatError
    from extract.run import run

    try:
        cfg = ExtractConfig(**kw)
        summary = run(cfg)
    except (CacheFormatError, ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if not summary:
        return
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"data {summary['data']}")
    click.echo(f"store {summary['store']}: {summary['samples_in_store']} samples "
               f"({summary['samples_written_now']} written now, {summary['already_committed']} already committed)")
    for reason, n in sorted(summary["skipped"].items()):
        click.echo(f"  skipped {n:>6}  {reason}")
    rates = ", ".join(f"{r:,.0f}" for r in summary["tokens_per_s_per_rank"])
    click.echo(f"tokens {summary['tokens_now']:,} at [{rates}] tok/s per rank; layers {summary['layer_ids']}")
    click.echo(f"bytes/token {summary['bytes_per_token']:,.0f}; store {summary['store_bytes'] / 2**20:,.1f} MiB; "
               f"buckets {summary['buckets']}; wall {summary['wall_s']:.1f}s")


if __name__ == "__main__":
    main()
