"""The peer side by side: speculators 0.9.0's drafters on our samples, and their checkpoints decoded
by `train.eval` as ours are.

    python -m bench peers rows --store S --out D              # S's samples as rows for prepare-data
    python -m bench peers hidden --store S --data D           # then their hidden-state files, in its order
    python -m bench peers convert --checkpoint CK --store S --out E   # its checkpoint -> our export
    python -m bench peers check-layout --export X --verifier HF  # ours in its layout, loaded by it
    python -m bench peers plan --log PROBE_LOG --seconds T    # its steps and epochs in T s of training

speculators trains offline from an Arrow dataset of `input_ids` / `loss_mask` rows (its
`prepare-data` passes rows that carry both straight through) and one `hidden_states/hs_{i}.safetensors`
per row: `hidden_states` [T, taps + 1, H] and `token_ids` [T], where the extra last entry is the
target's last decoder layer before the final norm (its teacher is lm_head(norm(that))). A store keeps
the final state after the norm (`extract --last-hidden`); `hidden` writes it divided by the norm's
weight, an input the norm maps back onto it exactly, so the teacher's logits are the target's. Both
drafters then train from the same store and taps. `prepare-data` shuffles the rows, and the files are
named by its order: so `rows` comes before it and `hidden` after.

Its checkpoints use the DFlash authors' weight names (`layers.*`, `fc`, `hidden_norm`, `norm`; a
DSpark drafter adds `markov_head.markov_w1` / `markov_w2`, as ours), a frozen copy of the target's
embedding and lm_head rows (`d2t` maps its draft vocabulary onto the target's), a `verifier_norm` and,
for DSpark, a confidence head that serving without its adaptive budget does not use. `convert` keeps
what drafting reads and writes our export of it, so `train.eval --export E` decodes it against the
same target, prompts and lossless check as ours.

A side-by-side run (HF = the target as an HF directory: ~/.cache/draftcache/targets/SHA256 after
any load of the GGUF; speculators' layer ids are ours + 1; its flags as of 0.9.0):

    python -m extract --config configs/smollm2-h200/extract.toml --store S --data SUBSET --last-hidden
    python -m train --config configs/smollm2-h200/train.toml --store S --out OURS --time-limit T
    python -m bench peers rows --store S --out D
    speculators prepare-data --model HF --data D/rows.jsonl --output D --minimum-valid-tokens 0 --seq-length 1024
    python -m bench peers hidden --store S --data D
    speculators train --speculator-type dspark --verifier-name-or-path HF --data-path D --num-layers 5 \
        --block-size 8 --target-layer-ids 2 9 15 21 28 --mask-token-id 16 --full-attention-indices 0 1 2 3 4 \
        --no-sample-from-anchor --no-enable-confidence-head --lr 1.2e-3 --scheduler-type cosine \
        --max-steps N --save-path CK        # N: its steps in T seconds (dflash: --speculator-type dflash)
    python -m bench peers convert --checkpoint CK/... --store S --out E
    python -m train.eval --export E --limit 48 --max-new-tokens 96 --no-prompt-lookup --tree-budget 0,512

speculators' training needs a GPU (it moves the drafter to the accelerator); on a CPU its
`train --dry-run` writes an initialized checkpoint, which `convert` and `train.eval` take.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from bench.peers_table import decode_rows, load_reports, markdown_table
from bench.tau_difference import difference_rows
from cache_format import CacheFormatError, StoreReader
from train.export import as_whole_head, from_export_names, write_export
from train.model import DrafterConfig

# what a converted drafter keeps of a speculators checkpoint: the backbone and the Markov head
KEPT = ("layers.", "fc.", "hidden_norm.", "norm.", "markov_head.markov_w1.", "markov_head.markov_w2.")
# frozen copies of the target's tensors and heads that drafting as we serve it does not read
DROPPED = ("embed_tokens.", "lm_head.", "verifier_lm_head.", "verifier_norm.", "t2d", "confidence_head.")
CHUNK = 64  # samples read from the store at a time


def write_peer_rows(store: str, out: str, *, limit: int = 0) -> dict:
    """The store's samples (the first `limit`, 0 = all) as rows speculators' `prepare-data` passes
    through: `out`/rows.jsonl (input_ids, loss_mask), written whole or not at all."""
    reader = StoreReader(store, verify_shards=True)
    if not reader.manifest.last_hidden:
        raise ValueError(f"{store}: it holds no final hidden state, which speculators' teacher reads: extract "
                         "with --last-hidden")
    ids = reader.sample_ids[: limit or None]
    Path(out).mkdir(parents=True, exist_ok=True)
    dst = Path(out) / "rows.jsonl"
    with open(str(dst) + ".partial", "w") as rows:
        for lo in range(0, len(ids), CHUNK):
            for s in reader.get_batch(ids[lo:lo + CHUNK]):
                rows.write(json.dumps({"input_ids": s.input_ids.tolist(),
                                       "loss_mask": [int(x) for x in s.loss_mask.tolist()]}) + "\n")
    os.replace(str(dst) + ".partial", dst)
    return {"rows": len(ids), "out": str(dst)}


def store_tokens(reader: StoreReader) -> dict[tuple[int, ...], int]:
    """Each sample's token ids -> its sample id, read from the token arrays alone (no hidden states)."""
    idx, out = reader.index, {}
    for gi, key in enumerate(idx.groups):
        ids = reader.group_tokens(key)["input_ids"]  # [N] the group's tokens, samples back to back
        for r in np.flatnonzero(idx.group == gi):
            lo = int(idx.start[r])
            out[tuple(ids[lo:lo + int(idx.length[r])].tolist())] = int(idx.sample_ids[r])
    return out


def _write_hidden_files(store: str, tmp: str, jobs: list[tuple[int, int]], w: torch.Tensor) -> int:
    """hs_{i}.safetensors for each (i, sample id) of `jobs`; one process of the pool. Returns bytes written."""
    torch.set_num_threads(1)
    reader = StoreReader(store, verify_shards=True)
    k, h, nbytes = len(reader.manifest.layer_ids), reader.manifest.target.hidden_size, 0
    for lo in range(0, len(jobs), CHUNK):
        part = jobs[lo:lo + CHUNK]
        for (i, _), s in zip(part, reader.get_batch([sid for _, sid in part])):
            # an input of the final norm that it maps onto the stored state: norm(last / w) = last, as
            # rms(last / w) = 1; the teacher, lm_head(norm(.)), is then the target's own logits
            last = (s.last_hidden.float() / w).unsqueeze(1)  # [T, 1, H]
            hidden = torch.cat([s.hidden.view(-1, k, h).float(), last], 1).to(torch.bfloat16)  # [T, K + 1, H]
            path = os.path.join(tmp, f"hs_{i}.safetensors")
            save_file({"hidden_states": hidden, "token_ids": s.input_ids.long().contiguous()}, path)
            nbytes += os.path.getsize(path)
    return nbytes


def write_peer_hidden(store: str, out: str, order: list[list[int]], *, procs: int = 0) -> dict:
    """hidden_states/hs_{i}.safetensors under `out` for the i-th row of `order` (the token ids of the
    rows as `prepare-data` left them: it shuffles), each the store's sample of those tokens, written by
    `procs` processes (0: one a core, at most 16). Written beside and renamed into place at the end: a
    stopped run leaves no hidden_states/."""
    reader = StoreReader(store, verify_shards=True)
    m = reader.manifest
    if not m.last_hidden:
        raise ValueError(f"{store}: it holds no final hidden state, which speculators' teacher reads: extract "
                         "with --last-hidden")
    w = reader.frozen()["norm.weight"].float() if m.last_hidden_post_norm else torch.ones(m.target.hidden_size)
    if bool((w.abs() < 1e-6).any()):
        raise ValueError(f"{store}: the target's final norm has zero weights: its input cannot be recovered")
    by_tokens = store_tokens(reader)
    missing = [i for i, ids in enumerate(order) if tuple(ids) not in by_tokens]
    if missing:
        raise ValueError(f"{out}: {len(missing)} prepared rows (first: row {missing[0]}) are no sample of {store}")
    dst, tmp = Path(out) / "hidden_states", Path(out) / "hidden_states.partial"
    if dst.exists():
        raise ValueError(f"{dst} exists: remove it to write it again")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    jobs = [(i, by_tokens[tuple(ids)]) for i, ids in enumerate(order)]
    n = max(1, min(procs or min(16, os.cpu_count() or 1), len(jobs)))
    # spawned, not forked: the parent's zarr runs an event-loop thread that a fork would copy mid-flight
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        nbytes = sum(pool.map(_write_hidden_files, [store] * n, [str(tmp)] * n, [jobs[j::n] for j in range(n)],
                              [w] * n))
    os.replace(tmp, dst)
    return {"rows": len(order), "taps": len(m.layer_ids) + 1, "hidden_bytes": nbytes, "out": str(dst)}


def prepared_order(data: str) -> list[list[int]]:
    """The token ids of the rows of a `speculators prepare-data` output directory, in its order."""
    try:
        # speculators' own dependency: installed with it, not with us
        from datasets import load_from_disk
    except ImportError:
        raise ValueError("reading prepare-data's output needs the `datasets` package that speculators "
                         "installs") from None
    try:
        return [list(map(int, r)) for r in load_from_disk(data).with_format(None)["input_ids"]]
    except (OSError, ValueError, FileNotFoundError) as e:
        raise ValueError(f"{data}: not a prepare-data output ({e})") from None


def probe_plan(log: str, seconds: float, *, margin: float = 0.95) -> dict:
    """The steps of `speculators train` that fit `seconds` of training, from the log of a probe run: its
    profile lines' step_ms (the first is step 0, compilation included; the last a steady step) and its
    progress bars' epoch length. The epochs returned just hold the steps: with more, it goes on past
    --max-steps through empty epochs, each validated and saved."""
    ms = [float(m) for m in re.findall(r"profile/step_ms=([0-9.]+(?:e[+-]?[0-9]+)?)", log)]
    if len(ms) < 2:
        raise ValueError("the probe's log holds fewer than two profile lines (its step 0 and a later "
                         "one): it stopped before a steady step, or --log-freq exceeds its steps")
    per_epoch = max((int(t) for t in re.findall(r"^Epoch \d+ .*?\d+/(\d+)\s+\[", log, re.M)), default=0)
    if per_epoch < 1:
        raise ValueError("the probe's log shows no epoch progress bar (`Epoch N ... i/n [`)")
    first_s, step_s = ms[0] / 1000, ms[-1] / 1000
    steps = int(margin * (seconds - first_s) / step_s)
    if steps < 1:
        raise ValueError(f"its first step took {first_s:.0f} s: no step fits {seconds:g} s")
    return {"steps": steps, "epochs": -(-steps // per_epoch), "steps_per_epoch": per_epoch,
            "first_step_s": first_s, "step_ms": ms[-1]}


def speculators_drafter(cfg: dict, *, vocab_size: int) -> DrafterConfig:
    """Our DrafterConfig of a speculators DFlash or DSpark checkpoint's config.json; one ValueError
    where it drafts in a way our served model does not."""
    kind = cfg.get("speculators_model_type")
    if kind not in ("dflash", "dspark"):
        raise ValueError(f"a {kind!r} drafter: only dflash and dspark checkpoints convert")
    if cfg.get("sample_from_anchor"):
        raise ValueError("it drafts from the anchor slot (sample_from_anchor): ours serve the anchor as the "
                         "verified token; train it with --no-sample-from-anchor")
    if kind == "dspark" and cfg.get("markov_rank") and cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"its Markov head is {cfg['markov_head_type']!r}: only the vanilla head converts")
    t = cfg["transformer_layer_config"]
    rope = t.get("rope_parameters") or {}
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab_size)
    return DrafterConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                         num_layers=t["num_hidden_layers"], num_heads=t["num_attention_heads"],
                         num_kv_heads=t["num_key_value_heads"],
                         head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                         vocab_size=vocab_size, num_taps=len(cfg["aux_hidden_state_layer_ids"]),
                         block_size=cfg["block_size"], mask_token_id=cfg["mask_token_id"],
                         rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
                         rms_eps=t["rms_norm_eps"], draft_vocab_size=0 if draft_vocab == vocab_size else draft_vocab,
                         markov_rank=int(cfg.get("markov_rank") or 0) if kind == "dspark" else 0)


def speculators_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weight names of what a speculators checkpoint drafts with; its d2t (offsets: target id =
    draft index + d2t) becomes draft_ids. A tensor neither kept nor known to be unused is an error."""
    out, unknown = {}, []
    for key, v in weights.items():
        if key.startswith(KEPT):
            out[key] = v
        elif key == "d2t":
            out["draft_ids"] = torch.arange(v.numel(), dtype=torch.long) + v.long()
        elif not key.startswith(DROPPED):
            unknown.append(key)
    if unknown:
        raise ValueError(f"tensors this converter does not know: {', '.join(sorted(unknown)[:5])}")
    return from_export_names(out)


def convert_checkpoint(checkpoint: str, store: str, out: str, *, whole_head: bool = True) -> Path:
    """Our export (train.export's layout) of a speculators checkpoint directory, for the target of
    `store` (its identity goes into the export, so train.eval finds and checks that target)."""
    ck = Path(checkpoint)
    try:
        cfg = json.loads((ck / "config.json").read_text())
        weights = load_file(str(ck / "model.safetensors"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{checkpoint}: not a readable speculators checkpoint ({e})") from None
    m = StoreReader(store).manifest
    try:
        dc = speculators_drafter(cfg, vocab_size=m.target.vocab_size)
        ours = speculators_weights(weights)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{checkpoint}: {e if isinstance(e, ValueError) else f'config.json lacks {e}'}") from None
    layer_ids = [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]  # HF hidden_states indices -> ours
    if not set(layer_ids) <= set(m.layer_ids):
        raise ValueError(f"{checkpoint}: it reads target layers {layer_ids}, {store} taps {list(m.layer_ids)}")
    if "sliding_attention" in (cfg["transformer_layer_config"].get("layer_types") or []):  # ours see it all
        raise ValueError(f"{checkpoint}: some of its layers attend to a sliding window, ours to the whole context: "
                         "train it with --full-attention-indices naming every layer")
    state = {"drafter": dc.to_dict(), "layer_ids": layer_ids, "num_target_layers": m.target.num_layers,
             "mask_token": m.mask_token if dc.mask_token_id == m.mask_token_id else "", "target": m.target.name,
             "target_sha256": m.target.sha256,
             "target_config": {"max_position_embeddings": m.target.config.get("max_position_embeddings")}}
    if whole_head:
        state, ours = as_whole_head(state, ours)
    return write_export(Path(out), state, ours)


def check_speculators_load(export: str, verifier: str) -> dict:
    """Load an export written with `train.export --layout speculators` by speculators' own classes
    (its verifier: the target as an HF directory) and compare every tensor of the file with the
    loaded model's; ValueError where a tensor is missing, unexpected or not equal."""
    try:
        from speculators import SpeculatorModel  # the peer: installed for the bench, never with us
    except ImportError:
        raise ValueError("this check needs speculators installed (pip install --no-deps speculators==0.9.0 "
                         "and its dependencies)") from None
    with tempfile.TemporaryDirectory() as tmp:  # the export's verifier path is rewritten in a copy
        cfg = json.loads((Path(export) / "config.json").read_text())
        cfg["speculators_config"]["verifier"]["name_or_path"] = verifier
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        os.symlink(Path(export, "model.safetensors").resolve(), Path(tmp) / "model.safetensors")
        model, info = SpeculatorModel.from_pretrained(tmp, output_loading_info=True)
        held = load_file(str(Path(export) / "model.safetensors"))
    problems = {k: v for k, v in info.items() if v}
    state = model.state_dict()
    unequal = [k for k, v in held.items() if k not in state or not torch.equal(state[k].to(v.dtype), v)]
    if problems or unequal:
        raise ValueError(f"{export}: speculators loads it with {problems or 'no complaint'}, unequal tensors "
                         f"{unequal[:3]}")
    return {"class": type(model).__name__, "tensors": len(held), "equal": True}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench peers", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="do", required=True)
    r = sub.add_parser("rows", help="a store's samples as rows for speculators prepare-data")
    r.add_argument("--store", required=True, help="a store extracted with --last-hidden")
    r.add_argument("--out", required=True, help="directory for rows.jsonl")
    r.add_argument("--limit", type=int, default=0, help="the first N samples only (0 = all)")
    d = sub.add_parser("hidden", help="the hidden-state files of prepare-data's rows, from the store")
    d.add_argument("--store", required=True, help="the store the rows came from")
    d.add_argument("--data", required=True, help="prepare-data's output directory (hidden_states/ goes there)")
    d.add_argument("--procs", type=int, default=0, help="processes writing the files (0: one a core, at most 16)")
    c = sub.add_parser("convert", help="a speculators dflash or dspark checkpoint as our export")
    c.add_argument("--checkpoint", required=True, help="its checkpoint directory (config.json, model.safetensors)")
    c.add_argument("--store", required=True, help="the store it was trained from (the target's identity)")
    c.add_argument("--out", required=True, help="the export directory to write")
    c.add_argument("--draft-head", action="store_true",
                   help="draft from its draft vocabulary only (as trained); default: the target's whole lm_head")
    p = sub.add_parser("plan", help="its steps and epochs in SECONDS of training, from a probe run's log")
    p.add_argument("--log", required=True, help="the probe's output (stdout and stderr of speculators train)")
    p.add_argument("--seconds", type=float, required=True, help="the seconds its training may take")
    k = sub.add_parser("check-layout", help="load an export in speculators' layout with speculators itself")
    k.add_argument("--export", required=True, help="written by python -m train.export --layout speculators")
    k.add_argument("--verifier", required=True, help="the target as an HF directory")
    t = sub.add_parser("table", help="one markdown table of train.eval reports: τ per domain, chain and trees")
    t.add_argument("--eval", action="append", required=True, metavar="NAME=PATH",
                   help="a drafter's name and its eval.json (train.eval --json); repeat for each")
    a = ap.parse_args()
    try:
        if a.do == "rows":
            print(json.dumps(write_peer_rows(a.store, a.out, limit=a.limit)))
        elif a.do == "hidden":
            print(json.dumps(write_peer_hidden(a.store, a.data, prepared_order(a.data), procs=a.procs)))
        elif a.do == "plan":
            print(json.dumps(probe_plan(Path(a.log).read_text(errors="replace").replace("\r", "\n"), a.seconds)))
        elif a.do == "table":
            reports = load_reports(a.eval)
            print(markdown_table(*decode_rows(reports)))
            if len(reports) > 1:  # each drafter against the first, paired over the prompts
                print("\n" + markdown_table(*difference_rows(reports)))
        elif a.do == "check-layout":
            print(json.dumps(check_speculators_load(a.export, a.verifier)))
        else:
            print(convert_checkpoint(a.checkpoint, a.store, a.out, whole_head=not a.draft_head))
    except (CacheFormatError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
