"""The openai engine's rate against a local `transformers serve` at several concurrencies (CPU).

    python -m bench openai --prompts 32 --max-new-tokens 64 --concurrency 1,8,32 --json OUT.json

Starts the packaged SmolLM2 (a plain HF copy, float32) under `transformers serve` on 127.0.0.1,
sends the first N packaged training prompts through `extract.regenerate --engine openai` once per
concurrency (greedy), and reports new tokens per second; `--continuous-batching` serves with the
server's paged continuous batching. The in-process static engine on the same prompts is the
reference row.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--continuous-batching", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    from extract.regenerate.answers import regenerate
    from extract.regenerate.local_server import LocalServer
    from target.loader import save_hf_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_hf_dir("", Path(tmp) / "smol")
        kw = dict(limit=a.prompts, max_new_tokens=a.max_new_tokens, temperature=0.0)
        with LocalServer(model_dir, log=str(Path(tmp) / "server.log"), continuous_batching=a.continuous_batching) as s:
            for c in (int(x) for x in a.concurrency.split(",")):
                r = regenerate(out=str(Path(tmp) / f"c{c}.jsonl"), engine="openai", base_url=(s.url,), model=model_dir,
                               concurrency=c, **kw)
                rows.append({"engine": "openai", "concurrency": c, "written": r.written, "failed": r.failed,
                             "new_tokens": r.new_tokens, "seconds": round(r.seconds, 2),
                             "tok_per_s": round(r.new_tokens / r.seconds, 1)})
                print(json.dumps(rows[-1]), flush=True)
        r = regenerate(out=str(Path(tmp) / "static.jsonl"), engine="static", batch_size=a.prompts, **kw)
        rows.append({"engine": "static (in-process, float32)", "concurrency": a.prompts, "written": r.written,
                     "failed": 0, "new_tokens": r.new_tokens, "seconds": round(r.seconds, 2),
                     "tok_per_s": round(r.new_tokens / r.seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
    res = {"prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "continuous_batching": a.continuous_batching,
           "server": "transformers serve, CPU, float32", "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"{'engine':30} {'conc':>5} {'tok/s':>8} {'seconds':>8}")
    for r in rows:
        print(f"{r['engine']:30} {r['concurrency']:5} {r['tok_per_s']:8} {r['seconds']:8}")


if __name__ == "__main__":
    main()
