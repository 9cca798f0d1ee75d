import torch, collections, json
from transformers import AutoModel
from safetensors import safe_open
from cache_format.target import load_target, chat_ids, eos_ids
from cache_format.prompts import heldout_prompts
tgt = load_target("", device=torch.device("cpu"), dtype=torch.float32)
model, tok = tgt.model, tgt.tokenizer
d = AutoModel.from_pretrained("/tmp/e10680", trust_remote_code=True, dtype=torch.bfloat16).eval()
vocab = set(d.draft_ids.tolist()); bs = d.block_size
eos = eos_ids(tok, model)
P = heldout_prompts()
sel = [p for p in P if p[0].startswith('chat/')][:16] + [p for p in P if p[0].startswith('gsm8k/')][:16]
c = collections.Counter()
for name, msgs in sel:
    ids = chat_ids(tok, msgs)
    out = d.spec_generate(model, torch.tensor([ids]), max_new_tokens=96, eos_token_id=eos)
    new = out["sequences"][0, len(ids):].tolist(); acc = out["accepted"]
    k = name.split('/')[0]; pos = acc[0]
    for a in acc[1:]:
        c[k, 'steps'] += 1
        # a step emitting a tokens accepted a-1 drafts; if a-1 < bs-1 the token new[pos+a-1] is the target's
        # own choice where the drafter missed
        if a - 1 < bs - 1 and pos + a - 1 < len(new):
            c[k, 'rejections'] += 1
            c[k, 'oov_rejections'] += new[pos + a - 1] not in vocab
        pos += a
    c[k, 'tokens'] += len(new); c[k, 'forwards'] += len(acc)
    print(name, dict((kk[1], v) for kk, v in c.items() if kk[0] == k), flush=True)
print({f"{a}/{b}": v for (a, b), v in c.items()})
