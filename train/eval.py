"""python -m train.eval: acceptance length τ of a trained drafter against the real target.

    python -m train.eval --run runs/demo --limit 8 --max-new-tokens 64 --json
    python -m train.eval --run runs/demo --export exports/demo  # the served file and the checkpoint

For every prompt: target-only greedy decoding, DFlash speculative decoding and transformers'
prompt-lookup decoding. Speculative decoding is the export's own `spec_generate`
(train/modeling_dflash.py): the checkpoint is evaluated through that class in float32, the
export as a user loads it (AutoModel, trust_remote_code, bf16 weights). Reports τ (new tokens per
target forward over all prompts, the bonus and the prefill's forward included), the DFlash reference
benchmark's τ beside it (`tau_per_response`: per response over drafting steps only, then the mean
over responses; peers publish this one), the acceptance histogram, speedup, and `lossless`: every
DFlash output identical to the target's own greedy output. The target runs in --dtype (float32 by
default): in bfloat16 argmax ties flip with batch shape, so the check is exact only in float32.
--teacher-forced adds the drafter's acceptance at every anchor of the target's greedy output
(train.acceptance): sim_tau's counterpart on these prompts, and the decode that it implies.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import torch
from tqdm import tqdm
from transformers import AutoModel

from cache_format.layout import atomic_write_bytes
from chat.conversations import history, read_conversations, segments
from chat.prompts import evaluation_prompts, heldout_multiturn, validation_prompts
from runtime.cli import config_command
from target.loader import chat_ids, eos_ids, load_target, packaged_gguf, target_sha256
from train.acceptance import decode_chain, teacher_forced_accepts, vocab_rejections
from train.checkpoint import load_checkpoint, resolve_checkpoint
from train.eval_config import EvalConfig
from train.eval_report import Tally, plot, summary, tau_so_far
from train.export import as_whole_head, hf_drafter, read_export
from train.spec_decode import target_generate

__all__ = ["evaluate"]


def _prompts(spec: str, limit: int) -> list[tuple[str, list[dict]]]:
    if spec == "default":
        prompts = evaluation_prompts()
    elif spec == "validation":
        prompts = validation_prompts()
    elif spec == "multiturn":
        prompts = heldout_multiturn()
    else:
        # assistant turns are answered again by the target (_answer_earlier_turns): τ of the
        # last turn
        prompts = [(f"{spec}:{sid + 1}", msgs)
                   for sid, msgs in read_conversations(spec, skip_bad=False,
                                                       require_assistant=False)]
    return prompts[:limit] if limit else prompts


def _answer_earlier_turns(model, tok, msgs: list[dict], *, max_new_tokens: int,
                          eos: set[int]) -> list[dict]:
    """The conversation as decoding meets its last user turn: assistant messages dropped, every
    earlier user turn answered by the target's own greedy reply (what a served chat would hold)."""
    segs, answers = segments(msgs), []
    for _ in segs[:-1]:
        reply = target_generate(model, chat_ids(tok, history(segs, answers)),
                                max_new_tokens=max_new_tokens, eos=eos).tokens
        answers.append(tok.decode(reply, skip_special_tokens=True).strip())
    return history(segs, answers)


def _count_forwards(model):
    box = {"n": 0}
    h = model.register_forward_pre_hook(lambda *_: box.__setitem__("n", box["n"] + 1))
    return box, h


def _drafters(run: str, checkpoint: str, export: str,
              whole_head: bool = True) -> tuple[dict[str, Any], dict | None, str]:
    """{"checkpoint": model, "export": model} as asked, the checkpoint's state, and its path.
    whole_head: the checkpoint drafts from the target's whole lm_head, as train.export serves it by
    default."""
    out: dict[str, Any] = {}
    state, ck = None, ""
    if run:
        ck = str(resolve_checkpoint(run, checkpoint))
        weights, _, state = load_checkpoint(ck)
        out["checkpoint"] = hf_drafter(*(as_whole_head(state, weights) if whole_head
                                         else (state, weights)))
    if export:
        if not (Path(export) / "modeling_dflash.py").is_file():
            raise ValueError(f"{export}: not a draftcache export (no modeling_dflash.py)")
        read_export(export)  # the export check every entry point makes
        # exactly as a user loads it: the export's own modeling file, its bf16 weights; checked
        # against its config first (a layer the weights lack would decode from its random init,
        # "lossless")
        try:
            model, info = AutoModel.from_pretrained(export, trust_remote_code=True,
                                                    dtype=torch.bfloat16, output_loading_info=True)
        except Exception as e:  # transformers raises many types for a damaged directory
            raise ValueError(f"{export}: cannot be loaded as an export ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
        wrong = [*info.get("missing_keys", []), *[k[0] if isinstance(k, tuple) else k
                                                 for k in info.get("mismatched_keys", [])]]
        if wrong:
            raise ValueError(f"{export}: model.safetensors does not hold what config.json "
                             f"describes ({len(wrong)} tensors missing or of another shape, e.g. "
                             f"{sorted(wrong)[0]})")
        out["export"] = model
    for name, d in out.items():  # a diverged run's weights would decode "lossless" at τ 1
        bad = [k for k, v in d.state_dict().items() if v.is_floating_point()
               and not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"{ck if name == 'checkpoint' else export}: the drafter's {bad[0]} "
                             "holds NaN or inf (a diverged run); not evaluated")
    return out, state, ck


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """τ of the checkpoint (float32 weights) and/or the export (bf16 weights, loaded as served);
    with both, the export's figures sit under "export" beside the checkpoint's (EvalConfig says what
    each option adds). With several tree budgets each prompt is decoded at every budget against one
    greedy baseline; the figures are the first budget's, and `tree_curve` holds every budget's."""
    budgets = list(cfg.tree_budget)
    drafters, state, ck = _drafters(cfg.run, cfg.checkpoint, cfg.export, not cfg.draft_head)
    target = cfg.target or ("" if state else _export_target(cfg.export))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tgt = load_target(target or state["target"], device=device, dtype=getattr(torch, cfg.dtype))
    model = tgt.model
    for name, d in drafters.items():  # the export keeps its bf16 weights, as served
        d.to(device=device, dtype=model.dtype if name == "checkpoint" else torch.bfloat16).eval()
    todo = _prompts(cfg.prompts, cfg.limit)
    if not todo:
        raise ValueError(f"--prompts {cfg.prompts}: no prompts to evaluate")
    # one key per drafter and budget: the first budget's under the drafter's own name
    keys = {_key(name, b, budgets): (name, b) for name in drafters for b in budgets}
    eos = eos_ids(tgt.tokenizer, model)
    rows, hist, t = _decode_all(cfg, todo, drafters, keys, tgt.model, tgt.tokenizer, eos, device)
    res = {which: summary(rows[which], hist[which], t, which, drafters[name], model, device,
                          prompt_lookup=cfg.prompt_lookup,
                          teacher_forced=cfg.teacher_forced and budget == 0,
                          cuda_graph=cfg.cuda_graph)
           for which, (name, budget) in keys.items()}
    for name in drafters:
        res[name].update(tree_budget=budgets[0], tree_width=cfg.tree_width)
        if len(budgets) > 1:
            res[name]["tree_curve"] = {str(b): _curve_point(res[_key(name, b, budgets)])
                                       for b in budgets}
    if "checkpoint" in res:
        out = {**res["checkpoint"], "checkpoint": ck, "whole_head": not cfg.draft_head}
        if "export" in res:
            out["export"] = {**{k: v for k, v in res["export"].items() if k != "prompts"},
                             "path": cfg.export}
        return out
    return {**res["export"], "export_path": cfg.export}


def _decode_all(cfg: EvalConfig, todo, drafters: dict, keys: dict, model, tok, eos, device):
    """Every prompt decoded greedily by the target alone (the baseline), by each drafter at each
    budget, and by prompt lookup where asked: (rows by key, acceptance histograms by key, Tally)."""
    rows: dict[str, list] = {k: [] for k in keys}
    hist = {k: Counter() for k in keys}
    t = Tally(spec_s=dict.fromkeys(keys, 0.0))
    # each drafter's vocabulary (None: the target's whole): a greedy token outside it is a certain
    # miss
    vocab = {k: None if getattr(drafters[n], "draft_ids", None) is None
             else set(drafters[n].draft_ids.tolist())
             for k, (n, _) in keys.items()}
    # prompts done, τ so far and the time left, on stderr (a CPU evaluation of 48 prompts takes an
    # hour)
    bar = tqdm(todo, desc=f"eval on {device.type}", unit="prompt", file=sys.stderr,
               dynamic_ncols=True)
    n = cfg.max_new_tokens
    for name, msgs in bar:
        ids = chat_ids(tok, _answer_earlier_turns(model, tok, msgs, max_new_tokens=n, eos=set(eos)))
        base = target_generate(model, ids, max_new_tokens=n, eos=set(eos))
        t.base_s, t.base_fw = t.base_s + base.seconds, t.base_fw + base.target_forwards
        for which, (dname, budget) in keys.items():
            drafter = drafters[dname]
            t0 = time.perf_counter()
            spec = drafter.spec_generate(model, torch.tensor([ids], device=device),
                                         max_new_tokens=n, eos_token_id=eos,
                                         tree_budget=budget, tree_width=cfg.tree_width,
                                         **({} if cfg.cuda_graph else {"cuda_graph": False}))
            t.spec_s[which] += time.perf_counter() - t0
            new = spec["sequences"][0, len(ids):].tolist()
            hist[which].update(spec["accepted"])
            rows[which].append({"prompt": name, "new_tokens": len(new),
                                "target_forwards": spec["target_forwards"],
                                "tau": len(new) / spec["target_forwards"],
                                "lossless": new == base.tokens,
                                "accepted": spec["accepted"], "greedy_tokens": len(base.tokens),
                                "in_draft_vocab": len(base.tokens) if vocab[which] is None
                                else sum(x in vocab[which] for x in base.tokens)})
            rej = vocab_rejections(spec["accepted"], new, vocab[which], drafter.block_size)
            rows[which][-1].update(rejections=rej[0], rejections_outside_vocab=rej[1])
            if cfg.teacher_forced and budget == 0:
                rows[which][-1].update(_teacher_forced_row(drafter, model, ids, base.tokens,
                                                           spec["accepted"]))
        pl_new, pl_fw = 0, 0
        if cfg.prompt_lookup:
            pl_new, pl_fw = _prompt_lookup(model, tok, ids, t, max_new_tokens=n, eos=eos)
        for r in rows.values():
            r[-1].update(prompt_lookup_new_tokens=pl_new, prompt_lookup_target_forwards=pl_fw)
        bar.set_postfix({f"tau_{k}" if len(rows) > 1 else "tau": f"{tau_so_far(r):.2f}"
                         for k, r in rows.items()})
    bar.close()
    return rows, hist, t


def _key(name: str, budget: int, budgets: list[int]) -> str:
    return name if budget == budgets[0] else f"{name}@tree{budget}"


def _without_prompts(res: dict[str, Any]) -> dict[str, Any]:
    """The report without its per-prompt rows, the tree curve's and the export's included (eval.json
    keeps them): the one JSON line --json prints."""
    curve = {b: {k: v for k, v in fig.items() if k != "prompts"}
             for b, fig in (res.get("tree_curve") or {}).items()}
    out = {k: _without_prompts(v) if k == "export" and isinstance(v, dict) else v
           for k, v in res.items() if k != "prompts"}
    return out | ({"tree_curve": curve} if curve else {})


def _curve_point(r: dict[str, Any]) -> dict[str, Any]:
    """One budget's figures in tree_curve, with each prompt's counts (a paired comparison of two
    drafters at that budget needs them: bench/tau_difference.py)."""
    return {**{k: r[k] for k in ("tau", "speedup", "tokens_per_s", "lossless", "tau_by_domain",
                                 "target_forwards")},
            "prompts": [{k: p[k] for k in ("prompt", "new_tokens", "target_forwards")}
                        for p in r["prompts"]]}


def _prompt_lookup(model, tok, ids: list[int], t: Tally, *, max_new_tokens: int,
                   eos: list[int]) -> tuple[int, int]:
    """transformers' prompt-lookup decoding of one prompt: (new tokens, target forwards), added to
    `t`."""
    box, h = _count_forwards(model)
    with torch.inference_mode():
        t0 = time.perf_counter()
        pl = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens,
                            do_sample=False,
                            prompt_lookup_num_tokens=10, pad_token_id=tok.pad_token_id or 0,
                            eos_token_id=eos)
        t.pl_s += time.perf_counter() - t0
    h.remove()
    new = pl.shape[1] - len(ids)
    t.pl_fw, t.pl_tokens = t.pl_fw + box["n"], t.pl_tokens + new
    return new, box["n"]


def _export_target(export: str) -> str:
    """The target an export names (config.json "draftcache_target"): its path hint if that file is
    still the target (same sha256), else the packaged default target if it is that one; otherwise a
    one-line error naming the target to pass with --target."""
    want = json.loads((Path(export) / "config.json").read_text()).get("draftcache_target") or {}
    if not want.get("sha256"):
        raise ValueError(f"{export}: the export does not name its target; pass --target")
    candidates = [want.get("path_hint", "")]
    try:
        candidates.append(packaged_gguf())
    except (ValueError, OSError):
        pass  # the packaged target is not installed
    for path in candidates:
        if path and Path(path).exists():
            try:
                if target_sha256(path) == want["sha256"]:
                    return path
            except (ValueError, OSError):
                continue
    raise ValueError(f"{export}: trained for the target {want.get('name') or '?'} (sha256 "
                     f"{want['sha256'][:12]}..., last seen at {want.get('path_hint') or '?'}), "
                     "which is not there; pass --target PATH")


def _teacher_forced_row(drafter, target, prompt: list[int], new: list[int],
                        decoded: list[int]) -> dict[str, Any]:
    """One prompt's teacher-forced figures: the summed acceptance (bonus included) over the anchors
    with a whole block of the greedy output ahead, their count, and the decode the acceptances
    imply."""
    acc = teacher_forced_accepts(drafter, target, prompt, new)
    full = [a + 1 for j, a in enumerate(acc) if j + drafter.block_size <= len(new)]
    chain = decode_chain(acc, len(new))
    return {"tf_anchor_sum": sum(full), "tf_anchors": len(full), "tf_chain_forwards": len(chain),
            "tf_chain_equals_decode": chain == list(decoded)}



@config_command(EvalConfig, extra=(click.Option(["--json", "as_json"], is_flag=True,
                                                help="Print one JSON object."),))
def main(cfg: EvalConfig, as_json: bool) -> None:
    """Speculative decoding with the drafter against the real target: τ, speedup, lossless."""
    try:
        res = evaluate(cfg)
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    out = Path(cfg.run or cfg.export)
    # whole or not at all: the tables (bench peers table) read it as the run's result
    atomic_write_bytes(out / "eval.json", json.dumps(res, indent=2).encode())
    plot(res, out / "acceptance.png")
    if as_json:
        click.echo(json.dumps(_without_prompts(res)))
        return
    click.echo(f"drafter {res.get('checkpoint') or res['export_path']} ({res['drafter_dtype']} "
               "weights)")
    click.echo(f"tau {res['tau']:.3f} over {res['num_prompts']} prompts, {res['new_tokens']} new "
               f"tokens ({res['target_forwards']} target forwards vs "
               f"{res['baseline_target_forwards']} greedy)")
    if res["tau_per_response"] is not None:
        click.echo("tau per response, drafting steps only (the DFlash benchmark's count) "
                   f"{res['tau_per_response']:.3f}")
    click.echo(f"lossless {res['lossless']} (checked in {res['lossless_dtype']}); speedup "
               f"{res['speedup']:.2f}x ({res['tokens_per_s']:.1f} vs "
               f"{res['baseline_tokens_per_s']:.1f} tok/s)")
    click.echo("draft vocabulary coverage of the target's greedy tokens "
               f"{res['draft_vocab_coverage']:.2%} ("
               + ", ".join(f"{k} {v:.2%}" for k, v in res["draft_vocab_coverage_by_domain"].items())
               + f"); rejections at a token outside it {res['rejections_outside_vocab']:.2%}")
    pl = res["prompt_lookup_tau_by_domain"]
    if pl is not None:
        click.echo(f"prompt lookup: tau {res['baseline_prompt_lookup_tau']:.3f}, speedup "
                   f"{res['baseline_prompt_lookup_speedup']:.2f}x")
    by = ", ".join(f"{k} {v:.3f}" + (f" (prompt lookup {pl[k]:.3f})" if pl is not None else "")
                   for k, v in res["tau_by_domain"].items())
    click.echo(f"tau by domain: {by}")
    for b, c in (res.get("tree_curve") or {}).items():
        click.echo(f"tree budget {b}: tau {c['tau']:.3f}, speedup {c['speedup']:.2f}x, lossless "
                   f"{c['lossless']} ("
                   + ", ".join(f"{k} {v:.3f}" for k, v in c["tau_by_domain"].items()) + ")")
    if "teacher_forced" in res:
        t = res["teacher_forced"]
        click.echo(f"teacher-forced: tau {t['tau_all_anchors']:.3f} at all {t['anchors']} anchors "
                   "(" + ", ".join(f"{k} {v:.3f}"
                                   for k, v in t["tau_all_anchors_by_domain"].items()) + "); "
                   f"implied decode tau {t['tau_chain']:.3f}, same steps as decoding in "
                   f"{t['chain_equals_decode']:.0%} of prompts")
    if "export" in res:
        e = res["export"]
        click.echo(f"export {e['path']} ({e['drafter_dtype']} weights, as served): tau "
                   f"{e['tau']:.3f}, lossless {e['lossless']}, speedup {e['speedup']:.2f}x")
    click.echo(f"acceptance histogram {res['acceptance_histogram']}; wrote {out / 'eval.json'}, "
               f"{out / 'acceptance.png'}")


if __name__ == "__main__":
    main()
