"""`python -m extract.regenerate`: the command line over extract.regenerate.answers (see the package
doc)."""

from __future__ import annotations

import dataclasses
import signal
import sys

import click

from extract.regenerate.config import RegenConfig
from runtime.cli import config_command
from runtime.preemption import from_the_start


@config_command(RegenConfig, seps={"shard": "/"}, extra=(
    click.Option(["--recipe"], default="",
                 help="'default': build the math + code + chat dataset into --out DIR."),
    click.Option(["--recipe-samples"], default=100_000, show_default=True,
                 help="--recipe: samples in all."),
    click.Option(["--recipe-long-tokens"], default=4096, show_default=True,
                 help="--recipe: the new-token cap of the long share (a tenth of the invented math "
                      "and code prompts); 0 = no long answers."),
))
@from_the_start
def main(cfg: RegenConfig, recipe: str, recipe_samples: int, recipe_long_tokens: int) -> None:
    """Generate target responses for prompts into a training JSONL."""
    from extract.regenerate.answers import regenerate  # here: torch loads with the signals noted

    try:
        if recipe:
            from extract.regenerate.recipe import build_recipe  # here: as regenerate above

            kw = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out"}
            build_recipe(recipe, out_dir=cfg.out, samples=recipe_samples,
                         long_tokens=recipe_long_tokens, **kw)
            return
        res = regenerate(cfg, preemptible=True)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if res.stopped_by_signal:  # the shell's code for that signal: a scheduler requeues the job
        name = signal.Signals(res.stopped_by_signal).name
        click.echo(f"stopped by {name} after writing {res.written} conversations to {cfg.out}: "
                   "rerun the same command to go on")
        sys.exit(128 + res.stopped_by_signal)
    click.echo(f"wrote {res.written} conversations to {cfg.out}")
    if res.failed:  # nothing is dropped silently: the errors file lists them, a rerun retries them
        click.echo(f"error: {res.failed} requests failed; see {cfg.out}.errors.jsonl and rerun to "
                   "retry them", err=True)
        sys.exit(3)


if __name__ == "__main__":
    from_the_start(main)()  # signals noted while click parses the options, too
