"""python -m bench SUITE [--params FILE] [flags]: one benchmark suite with its parameters.

    python -m bench list                      # the suites and what each measures
    python -m bench train                     # bench/suites/train.toml: the command of its BENCHMARKS figure
    python -m bench train --steps 5 --shape smollm2-135m --no-compile   # flags override the file's values

Each suite is a module of this package with its own flags (`python -m bench SUITE --help`); its
parameters file turns into flags placed before the ones given here, so the given ones win. The
figures and the machines they were measured on: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITES = {
    "store": ("bench.store_bench", "store write GB/s per process, random-batch read GB/s, 1M-sample open"),
    "extract": ("bench.extract_bench", "extraction with the store vs the bare forward (random-weight target)"),
    "train": ("bench.train_bench", "drafter training from the store vs in memory; MFU"),
    "ddp": ("bench.ddp_bench", "`python -m train` on 1 GPU vs N GPUs (DDP scaling)"),
    "layout": ("bench.layout_bench", "extract on GPU 0 while `train --follow` trains on GPU 1"),
    "layout-model": ("bench.layout_model", "the 8-GPU layout model from measured rates (a projection)"),
    "codec": ("bench.codec_bench", "bytes, error and lossless compression of bf16, fp8 and mxfp4 on real states (CPU)"),
    "objstore": ("bench.object_store_bench", "write and read GB/s of a store on an S3 server vs the local filesystem"),
    "worker": ("bench.worker_bench", "one DataLoader worker's seconds per micro-batch (CPU)"),
    "regen": ("bench.regen_bench", "regeneration engines side by side (static, HF generate, continuous batching)"),
    "openai": ("bench.openai_bench", "the openai engine against a local `transformers serve`"),
    "vocab": ("bench.vocab_bench", "a draft vocabulary's coverage of the target's greedy answers, by size (CPU)"),
    "replay": ("bench.replay_bench", "the held-out tree replay (a Markov head or none): trees at every block vs the visited"),
    "loss-kernel": ("bench.loss_kernel_bench", "the draft loss's chunks: ours against Liger's kernels (GPU)"),
    "trace": ("bench.trace_summary", "a profiled stretch's GPU idle time, streams, copies overlapped (bench train --trace)"),
    "recompiles": ("bench.recompile_bench", "how often a compiled drafter compiles over a run's micro-batch shapes"),
    "tree-step": ("bench.tree_step_bench", "where a draft-tree decoding step's time goes, by node budget (GPU)"),
    "confidence": ("bench.confidence_bench", "rejected drafts by the target's own top-1 probability there, per domain"),
    "peers": ("bench.peers_bench", "speculators' drafters on our samples: its input files, its checkpoints as our exports"),
    "preempt": ("bench.preempt_bench", "SIGTERM/SIGINT at random moments of train, extract and regenerate, then a rerun (CPU)"),
    "real-target": ("scripts/scale_run.sh", "the packaged target end to end: extract, train, eval (GPU machine)"),
}


def flags_of(params: dict) -> list[str]:
    """TOML values as command-line flags: key = 3 -> --key 3; true -> --key; false -> nothing;
    lists -> comma-joined."""
    out = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            continue
        elif isinstance(value, list):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(__doc__.split("\n\n")[0])
        for name, (_, what) in SUITES.items():
            print(f"  {name:13} {what}")
        return 0
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"error: unknown suite {suite!r}; `python -m bench list` names them", file=sys.stderr)
        return 2
    params = HERE / "suites" / f"{suite}.toml"
    if "--params" in rest:
        i = rest.index("--params")
        params, rest = Path(rest[i + 1]), rest[:i] + rest[i + 2:]
    try:
        values = tomllib.loads(params.read_text()) if params.exists() else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"error: {params}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for key in [k for k, v in values.items() if v is True]:  # --no-KEY turns off a flag the file sets
        off = "--no-" + key.replace("_", "-")
        if off in rest:
            values[key] = False
            rest = [x for x in rest if x != off]
    target, _ = SUITES[suite]
    if target.endswith(".sh"):  # a launcher of the GPU machine: its stages in order
        for stage in values.get("stages", ["extract", "train", "eval", "pack"]):
            rc = subprocess.call(["bash", str(HERE.parent / target), stage, *rest])
            if rc:
                return rc
        return 0
    sys.argv = [f"python -m bench {suite}", *flags_of(values), *rest]
    importlib.import_module(target).main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
