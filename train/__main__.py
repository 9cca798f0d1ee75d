"""python -m train: stage two. Train a DFlash drafter from a draftcache store.

    python -m train --store stores/demo.zarr --out runs/demo
    torchrun --nproc-per-node 8 -m train --store /dev/shm/q8b.zarr --out runs/q8b --num-layers 5
    python -m train --store S --out R --follow      # while `python -m extract` is still writing S
"""

from __future__ import annotations

import sys

import click

from train.config import GRAD_REDUCES, LOSS_BACKWARDS, TrainConfig


def _layers(_ctx, _param, value: str) -> tuple[int, ...]:
    from cache_format.schema import parse_layer_ids

    try:
        return parse_layer_ids(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings={"max_content_width": 100})
@click.option("--store", required=True, help="The draftcache store (the target is never loaded).")
@click.option("--out", required=True, help="Run directory (metrics.jsonl, plots, checkpoints/).")
@click.option("--num-layers", default=1, show_default=True, help="Drafter depth (DFlash: 5).")
@click.option("--layers", default="", callback=_layers, help="Subset of stored layer ids [default: all].")
@click.option("--block-size", default=16, show_default=True)
@click.option("--num-anchors", default=512, show_default=True, help="Anchors per sequence.")
@click.option("--gamma", default=0.0, help="Loss decay; 0 = 7 for block 16 (5 for 10, 4 for 8).")
@click.option("--loss", type=click.Choice(["ce", "kl", "mix"]), default="ce", show_default=True)
@click.option("--kl-weight", default=0.5, show_default=True, help="KL share with --loss mix.")
@click.option("--mask-token-id", default=-1, help="Embedding row used as MASK [default: last row].")
@click.option("--intermediate-size", default=0, help="Drafter MLP width [default: the target's].")
@click.option("--epochs", default=6, show_default=True)
@click.option("--max-steps", default=0, help="Stop after N optimizer steps (0 = all epochs).")
@click.option("--time-limit", default=0.0, help="Seconds this process may train (0 = no limit); then it "
              "checkpoints at the next --log-every step and exits 0: rerun with --resume to continue.")
@click.option("--token-budget", default=8192, show_default=True, help="Context tokens per micro-batch.")
@click.option("--grad-accum", default=1, show_default=True)
@click.option("--lr", default=6e-4, show_default=True)
@click.option("--warmup", default=0.04, show_default=True)
@click.option("--weight-decay", default=0.0, show_default=True)
@click.option("--clip", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--log-every", default=10, show_default=True)
@click.option("--checkpoint-every", default=0, help="Checkpoint every N steps (0 = at the end).")
@click.option("--keep-checkpoints", default=3, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out.")
@click.option("--follow", is_flag=True, help="Train while stage one is still writing the store.")
@click.option("--workers", default=2, show_default=True, help="DataLoader workers per rank.")
@click.option("--verify-shards", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Check each data shard's checksums on first read (auto: on with --follow).")
@click.option("--attention", type=click.Choice(["auto", "flex", "sdpa"]), default="auto", show_default=True)
@click.option("--compile", is_flag=True,
              help="torch.compile each drafter layer (fuses norms, RoPE, SwiGLU) and the fused loss chunks.")
@click.option("--loss-chunk", default=2048, show_default=True, help="Draft positions per lm_head + loss chunk.")
@click.option("--loss-backward", type=click.Choice(LOSS_BACKWARDS), default="fused", show_default=True,
              help="lm_head chunk gradients: formed in the forward pass (fused), rebuilt in backward "
              "(recompute: one more matmul), or from logits kept alive (keep: most memory).")
@click.option("--val-samples", default=0, show_default=True,
              help="Hold out N samples (whole prompts); log their teacher-forced val_loss/val_acc/val_sim_tau; "
              "keep the best val_sim_tau's weights as checkpoints/best-STEP.")
@click.option("--val-every", default=100, show_default=True, help="Steps between held-out evaluations.")
@click.option("--patience", default=0, show_default=True,
              help="Stop after N held-out evaluations in a row without a new best val_sim_tau (0 = never).")
@click.option("--grad-reduce", type=click.Choice(GRAD_REDUCES), default="fp32", show_default=True,
              help="dtype of DDP's gradient all-reduce (bf16: half the bytes, rounded gradients).")
def main(**kw) -> None:
    """Train a DFlash drafter from a store (DDP under torchrun; resumable)."""
    from cache_format import CacheFormatError
    from train.trainer import train

    try:
        res = train(TrainConfig(**kw))
    except (CacheFormatError, ValueError, OSError) as e:
        click.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(2)
    stop = f" (stopped: {res['patience']} evaluations without a new best)" if res["stopped_early"] else ""
    if res["stopped_by_time"]:
        stop = f" (stopped by --time-limit {kw['time_limit']:g} s: rerun with --resume to continue)"
    click.echo(f"trained {res['steps']} steps into {res['run']}{stop}")


def _one_line(e: Exception) -> str:
    """The error's own message: a DataLoader worker's error arrives wrapped in its traceback text,
    whose last line is "module.ErrorType: message"."""
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    if len(lines) > 1 and "Traceback" in str(e):
        return lines[-1].split(": ", 1)[-1]
    return " ".join(lines)


if __name__ == "__main__":
    main()
