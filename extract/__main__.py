"""python -m extract: stage one. Target hidden states into a draftcache store.

    python -m extract --store stores/demo.zarr              # packaged SmolLM2 + default data
    python -m extract --store /dev/shm/q8b.zarr --target /models/Qwen3-8B --data chats.jsonl
    torchrun --nproc-per-node 8 -m extract --store /dev/shm/q8b.zarr --target ... --data ...
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m extract ...  # shared FS

Rerunning the same command resumes; other settings are refused unless --overwrite. Options come
from ExtractConfig; `--config FILE` (TOML/YAML) gives them by name, flags override the file.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from extract.config import ExtractConfig
from runtime.cli import config_command
from runtime.preemption import from_the_start


@config_command(ExtractConfig, extra=(click.Option(["--json", "as_json"], is_flag=True,
                                                 help="Print the closing summary as JSON."),))
@from_the_start
def main(cfg: ExtractConfig, as_json: bool) -> None:
    """Extract target hidden states into a draftcache store (resumable)."""
    # here, not at the top: --help and a bad option answer without loading torch
    from cache_format import CacheFormatError
    from extract.run import run

    try:
        summary = run(cfg, preemptible=True)
    except (CacheFormatError, ValueError, OSError) as e:
        click.echo(f"error: {_named(cfg, e)}", err=True)
        sys.exit(2)
    if not summary:
        return
    # preempted: what was extracted is committed; the same command goes on
    if summary.get("stopped_by_signal"):
        sig = summary["stopped_by_signal"]
        click.echo(f"stopped by {signal.Signals(sig).name}: {summary['store']} keeps every sample "
                   "committed so far; rerun the same command to go on", err=True)
        sys.exit(128 + sig)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"data {summary['data']}")
    click.echo(f"store {summary['store']}: {summary['samples_in_store']} samples "
               f"({summary['samples_written_now']} written now, {summary['already_committed']} "
               "already committed)")
    for reason, n in sorted(summary["skipped"].items()):
        click.echo(f"  skipped {n:>6}  {reason}")
    rates = ", ".join(f"{r:,.0f}" for r in summary["tokens_per_s_per_rank"])
    click.echo(f"tokens {summary['tokens_now']:,} at [{rates}] tok/s per rank; layers "
               f"{summary['layer_ids']}")
    click.echo(f"bytes/token {summary['bytes_per_token']:,.0f}; store "
               f"{summary['store_bytes'] / 2**20:,.1f} MiB; buckets {summary['buckets']}; wall "
               f"{summary['wall_s']:.1f}s")


def _named(cfg: ExtractConfig, e: Exception) -> str:
    """The error, or what caused it where zarr only says a node is missing: the store's directory
    (the staging directory of a store written to a URL) removed while the run wrote it."""
    # here, as above: only a failed run needs them
    from zarr.errors import NodeNotFoundError

    from cache_format.remote import default_local, is_url

    where = Path(cfg.stage_dir
                 or default_local(cfg.store)) if is_url(cfg.store) else Path(cfg.store)
    if isinstance(e, NodeNotFoundError) and not (where / "zarr.json").exists():
        why = " ".join(str(e).split())[:120]
        return f"{where}: the store's directory was removed while this run wrote it ({why})"
    return str(e)


if __name__ == "__main__":
    from_the_start(main)()  # signals noted while click parses the options, too
