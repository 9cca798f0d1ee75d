"""`draftcache SUBCOMMAND ...`: the stages' command lines under one name, as peers ship `speculators
train` and `specforge train`. Each subcommand is the very command its `python -m` form runs (the
same click command object, so the same options derived from the same config dataclass); this module
only names them. Subcommands import their stage when called, so `draftcache --help` and one stage's
start-up load nothing of the others.

    draftcache extract --store S.zarr            # python -m extract
    draftcache train --store S.zarr --out RUN    # python -m train
    draftcache eval --run RUN                    # python -m train.eval
    draftcache inspect S.zarr                    # python -m cache_format inspect
"""

from __future__ import annotations

import importlib

import click

__all__ = ["main"]

# subcommand -> (module, attribute, its python -m form, one line of help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "extract": ("extract.__main__", "main", "python -m extract",
                "Extract target hidden states into a store (stage one)."),
    "regenerate": ("extract.regenerate.__main__", "main", "python -m extract.regenerate",
                   "Generate the target's responses to prompts into a training JSONL."),
    "train": ("train.__main__", "main", "python -m train",
              "Train a DFlash drafter from a store (stage two)."),
    "eval": ("train.eval", "main", "python -m train.eval",
             "Speculative decoding against the real target: tau and speedup."),
    "export": ("train.export", "main", "python -m train.export",
               "Export a trained drafter for AutoModel, SGLang and vLLM."),
    "inspect": ("cache_format.__main__", "inspect", "python -m cache_format inspect",
                "A store's manifest, buckets, shards and bytes per token."),
    "verify": ("cache_format.__main__", "verify", "python -m cache_format verify",
               "Check every file of a store."),
    "show": ("cache_format.__main__", "show", "python -m cache_format show",
             "One sample decoded, its supervised spans marked."),
    "plot": ("cache_format.__main__", "plot", "python -m cache_format plot",
             "A histogram of a store's sample lengths into a PNG."),
}


class _Stages(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module, attr, _, _ = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # the one-line help from the table: listing must not import every stage
        with formatter.section("Commands"):
            formatter.write_dl([(n, f"{h} ({m})") for n, (_, _, m, h) in SUBCOMMANDS.items()])


@click.command(cls=_Stages)
@click.version_option(package_name="draftcache")
def main() -> None:
    """draftcache: train speculative-decoding drafters from an on-disk cache of target hidden
    states."""
