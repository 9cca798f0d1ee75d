"""python -m train: stage two. Train a DFlash drafter from a draftcache store.

    python -m train --store stores/demo.zarr --out runs/demo
    torchrun --nproc-per-node 8 -m train --store /dev/shm/q8b.zarr --out runs/q8b --num-layers 5
    python -m train --store S --out R --follow      # while `python -m extract` is still writing S
    python -m train --config configs/smollm2-demo/train.toml --epochs 2   # a file, a flag over it

Options come from TrainConfig (train/config.py), one per field.
"""

from __future__ import annotations

import signal
import sys

import click

from runtime.cli import config_command
from runtime.preemption import from_the_start
from train.config import TrainConfig


@config_command(TrainConfig)
@from_the_start
def main(cfg: TrainConfig) -> None:
    """Train a DFlash drafter from a store (DDP under torchrun; resumable)."""
    # here, not at the top: --help and a bad option answer without loading torch
    from cache_format import CacheFormatError
    from train.trainer import train

    try:
        res = train(cfg)
    except (CacheFormatError, ValueError, OSError) as e:
        click.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(2)
    stop = ""
    if res["stopped_early"]:
        stop = f" (stopped: {res['patience']} evaluations without a new best)"
    if res["stopped_by_time"]:
        stop = f" (stopped by --time-limit {cfg.time_limit:g} s: rerun with --resume to continue)"
    if res["stopped_by_signal"]:
        name = signal.Signals(res["stopped_by_signal"]).name
        click.echo(f"trained {res['steps']} steps into {res['run']} (stopped by {name}, checkpoint "
                   "saved: rerun with --resume to continue)")
        # the shell's code for that signal: a scheduler requeues it
        sys.exit(128 + res["stopped_by_signal"])
    click.echo(f"trained {res['steps']} steps into {res['run']}{stop}")


def _one_line(e: Exception) -> str:
    """The error's own message: a DataLoader worker's error arrives wrapped in its traceback text,
    whose last line is "module.ErrorType: message"."""
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    if len(lines) > 1 and "Traceback" in str(e):
        return lines[-1].split(": ", 1)[-1]
    return " ".join(lines)


if __name__ == "__main__":
    from_the_start(main)()  # signals noted while click parses the options, too
