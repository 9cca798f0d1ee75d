"""`python -m chat prompts {validation,evaluation,train} OUT`: a packaged prompt set as
conversations."""

from __future__ import annotations

import json
import sys

import click

from cache_format.layout import atomic_write_bytes
from chat.prompts import evaluation_prompts, train_prompts, validation_prompts


@click.group()
def cli() -> None:
    """The packaged prompt sets."""


@cli.command()
@click.argument("which", type=click.Choice(["validation", "evaluation", "train"]))
@click.argument("out", type=click.Path())
@click.option("--per-domain", default=0, show_default=True,
              help="validation: only the first N prompts of each "
              "domain (32: the evaluation's even mix); 0 = all 264.")
def prompts(which: str, out: str, per_domain: int) -> None:
    """Write a packaged prompt set as conversations (JSONL, user turns only) for extract.regenerate:
    validation (the held-out prompts the evaluation's test leaves: for `train --val-store`),
    evaluation (every held-out prompt, the test first) or train (GSM8K minus held-out, GPQA,
    AIME)."""
    try:
        if per_domain < 0 or (per_domain and which != "validation"):
            raise ValueError("--per-domain must be >= 0 and goes with the validation set, got "
                             f"{per_domain} for {which}")
        convs = {"validation": lambda: validation_prompts(per_domain),
                 "evaluation": evaluation_prompts,
                 "train": lambda: [("", m) for m in train_prompts()]}[which]()
    except ValueError as e:  # a bad --per-domain, or a package that is not installed
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    lines = [json.dumps({"messages": m, **({"name": name} if name else {})}, ensure_ascii=False)
             for name, m in convs]
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())
    click.echo(f"{len(lines)} {which} prompts -> {out}")


if __name__ == "__main__":
    cli()
