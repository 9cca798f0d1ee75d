"""Each answer of a prompt set decoded by an export, cut at its verification steps (analysis helper).

    PYTHONPATH=. python docs/results/valstore-cpu/chat_segments.py EXPORT default 48 out.json
"""
import json
import sys

import torch

from target.loader import chat_ids, eos_ids, load_target
from train.eval import _drafters, _export_target, _prompts

torch.set_num_threads(2)
export, spec, limit, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
drafter = _drafters("", "", export)[0]["export"].to(torch.bfloat16).eval()
tgt = load_target(_export_target(export), device=torch.device("cpu"), dtype=torch.float32)
eos = eos_ids(tgt.tokenizer, tgt.model)
rows = []
for name, msgs in _prompts(spec, limit):
    if spec == "default" and not name.startswith("chat"):
        continue
    ids = chat_ids(tgt.tokenizer, msgs)
    s = drafter.spec_generate(tgt.model, torch.tensor([ids]), max_new_tokens=96, eos_token_id=eos)
    new = s["sequences"][0, len(ids):].tolist()
    pos, segs = 0, []
    for a in s["accepted"]:
        segs.append(tgt.tokenizer.decode(new[pos:pos + a]))
        pos += a
    rows.append({"prompt": name, "user": msgs[-1]["content"], "tau": len(new) / len(s["accepted"]),
                 "accepted": s["accepted"], "segments": segs})
    print(name, round(rows[-1]["tau"], 2), flush=True)
json.dump(rows, open(out, "w"), indent=1)
