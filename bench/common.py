"""What the benches share: model shapes, random-weight targets, synthetic manifests, a tiny tokenizer,
a synchronized timer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from cache_format import DatasetInfo, Manifest, TargetInfo
from cache_format.schema import default_rows_per_shard

__all__ = ["CORPUS", "GREEK", "SHAPES", "checked_export", "checked_store", "random_target", "synced_times",
           "synthetic_manifest", "tiny_target_dir", "tiny_tokenizer", "write_chats"]

# Qwen3Config fields of the shapes the goals are stated at (random weights: no download)
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1000),
}


def synced_times(fn: Callable[[], Any], device: torch.device, runs: int) -> tuple[list[float], Any]:
    """The seconds of each of `runs` calls of fn (the GPU synchronized before and after each), and the
    last call's result; the caller drops its warm-up calls and takes the median."""
    times, out = [], None
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, out


def random_target(shape: str, device: torch.device) -> torch.nn.Module:
    """A random-weight Qwen3 causal LM of `shape`, built on `device` (bf16 on a GPU: a float32 32B
    build would not fit)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[shape], attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def synthetic_manifest(*, name: str, hidden_size: int, vocab_size: int, layer_ids: tuple[int, ...],
                       max_len: int, bucket_bounds: tuple[int, ...], num_records: int = 0, num_layers: int = 36,
                       last_hidden: bool = False, dtype: str = "bfloat16", compression: str = "none",
                       rows_per_shard: int = 0, target_config: dict | None = None) -> Manifest:
    """The manifest of a store of synthetic rows (no real target: "-" where a hash would be)."""
    return Manifest(target=TargetInfo(name=name, sha256="-", num_layers=num_layers, hidden_size=hidden_size,
                                      vocab_size=vocab_size, config=target_config or {}),
                    tokenizer_sha256="-", layer_ids=layer_ids, mask_token_id=vocab_size - 1, last_hidden=last_hidden,
                    dataset=DatasetInfo(path="-", sha256="-", num_records=num_records), max_len=max_len,
                    bucket_bounds=bucket_bounds, dtype=dtype, compression=compression,
                    rows_per_shard=rows_per_shard or default_rows_per_shard(hidden_size, len(layer_ids)),
                    rows_per_chunk=32)


CORPUS = [
    "the quick brown fox jumps over the lazy dog", "what is two plus two? two plus two is four.",
    "def add(a, b): return a + b", "question answer user assistant system hello world",
    "numbers 0 1 2 3 4 5 6 7 8 9 ten eleven twelve", "alpha beta gamma delta epsilon zeta eta theta",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A 300-token byte-level BPE trained on CORPUS, with a ChatML template (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def start_moto(env: dict[str, str] | None = None):
    """moto's S3 server (its server mode: a process of its own) on a free local port, answering
    before this returns; `env` (os.environ by default) is pointed at it for obstore. Returns
    (the process, its endpoint URL). The object-storage tests and `python -m bench objstore` use it."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    (os.environ if env is None else env).update({
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"})
    return proc, endpoint


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server at `endpoint`; its name."""
    import urllib.request
    import uuid

    name = f"b{uuid.uuid4().hex[:12]}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{name}", method="PUT"), timeout=10)
    return name


def tiny_target_dir(path, arch: str = "llama", num_layers: int = 6, hidden: int = 32, seed: int = 0) -> str:
    """Save a random-weight causal LM + tokenizer as an HF directory (no download)."""
    import transformers

    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    common = dict(vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  initializer_range=0.2)  # a frozen lm_head of std 0.02 could barely move the logits
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=hidden // 4, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


GREEK = "alpha beta gamma delta epsilon zeta eta theta".split()


def write_chats(path, n: int, seed: int = 0, turns: int = 1, cyclic: bool = False) -> str:
    """Random conversations; with `cyclic` the answers cycle through GREEK (learnable by a drafter)."""
    import json
    import random

    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    with open(path, "w") as f:
        for _ in range(n):
            msgs = []
            for _ in range(turns):
                msgs.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))})
                if cyclic:
                    start = rng.randrange(len(GREEK))
                    answer = [GREEK[(start + i) % len(GREEK)] for i in range(rng.randint(10, 40))]
                else:
                    answer = rng.choices(words, k=rng.randint(10, 60))
                msgs.append({"role": "assistant", "content": " ".join(answer)})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return str(path)


def checked_store(path: str):
    """A StoreReader of a store a suite is given, its shards checked on first read as training checks
    them: a damaged store ends the suite in one line naming the file, never with a figure from it."""
    from cache_format import CacheFormatError, StoreReader

    try:
        return _Checked(StoreReader(path, verify_shards=True))
    except CacheFormatError as e:
        raise SystemExit(f"error: {e}") from None


class _Checked:
    """A reader whose reads end the suite in one line on a damaged shard."""

    def __init__(self, reader) -> None:
        self.reader, self.manifest, self.sample_ids = reader, reader.manifest, reader.sample_ids

    def get_batch(self, ids):
        from cache_format import CacheFormatError

        try:
            return self.reader.get_batch(ids)
        except CacheFormatError as e:
            raise SystemExit(f"error: {e}") from None


def checked_export(path: str) -> None:
    """What train.eval and train.replay_score check of an export a suite is given (config, weights,
    every tensor its config claims), or the suite ends in one line naming it."""
    from train.export import read_export

    try:
        read_export(path)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
