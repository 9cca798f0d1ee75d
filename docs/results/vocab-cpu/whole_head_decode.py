import torch, collections
from transformers import AutoModel
from cache_format.target import load_target, chat_ids, eos_ids
from cache_format.prompts import heldout_prompts
from train.spec_decode import target_generate
tgt = load_target("", device=torch.device("cpu"), dtype=torch.float32)
model, tok = tgt.model, tgt.tokenizer
d = AutoModel.from_pretrained("/tmp/e10680", trust_remote_code=True, dtype=torch.bfloat16).eval()
d.draft_ids = None  # draft from the target's whole lm_head, though trained on 12,288 of its rows
eos = eos_ids(tok, model)
P = heldout_prompts()
sel = [p for p in P if p[0].startswith('chat/')][:16] + [p for p in P if p[0].startswith('gsm8k/')][:16]
c = collections.Counter()
for name, msgs in sel:
    ids = chat_ids(tok, msgs)
    out = d.spec_generate(model, torch.tensor([ids]), max_new_tokens=96, eos_token_id=eos)
    new = out["sequences"][0, len(ids):].tolist()
    base = target_generate(model, ids, max_new_tokens=96, eos=set(eos)).tokens
    k = name.split('/')[0]
    c[k, 'tokens'] += len(new); c[k, 'forwards'] += len(out["accepted"]); c[k, 'lossless'] += new == base
    print(name, round(len(new) / len(out["accepted"]), 2), flush=True)
for k in ('chat', 'gsm8k'):
    print(k, c[k, 'tokens'], c[k, 'forwards'], round(c[k, 'tokens'] / c[k, 'forwards'], 3), 'lossless', c[k, 'lossless'])
