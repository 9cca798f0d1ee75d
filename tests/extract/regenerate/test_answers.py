from __future__ import annotations

import json

import pytest

from extract.regenerate.answers import pre_query_text, regenerate
from tests.helpers import tiny_target_dir, write_chats


def _records(path) -> dict[tuple[int, int], str]:
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            assert r["messages"][-1]["role"] == "assistant"
            out[(r["prompt_index"], r["sample"])] = r["messages"][-1]["content"]
    return out


def test_shards_and_resume_reproduce_one_run(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "llama")
    prompts = write_chats(tmp_path / "p.jsonl", 5)
    kw = dict(target=target, prompts=prompts, num_samples=2, temperature=0.8, max_new_tokens=6, batch_size=3, seed=1)
    assert regenerate(out=str(tmp_path / "one.jsonl"), **kw).written == 10
    one = _records(tmp_path / "one.jsonl")
    assert len(one) == 10 and len(set(one.values())) > 1  # sampled, seeded per batch
    # two shards (one process per GPU) hold exactly what one run wrote
    for i in range(2):
        regenerate(out=str(tmp_path / f"s{i}.jsonl"), shard=(i, 2), **kw)
    a, b = _records(tmp_path / "s0.jsonl"), _records(tmp_path / "s1.jsonl")
    assert not a.keys() & b.keys() and {**a, **b} == one
    # a run cut short (torn last line) and rerun writes only what was missing
    lines = (tmp_path / "one.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text("".join(lines[:4]) + lines[4][:7])
    assert regenerate(out=str(tmp_path / "cut.jsonl"), **kw).written == 6
    assert _records(tmp_path / "cut.jsonl") == one



def _prompts(path) -> dict[int, str]:
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            assert [m["role"] for m in r["messages"]] == ["user"] and r["sample"] == 0
            out[r["prompt_index"]] = r["messages"][0]["content"]
    return out


def test_invented_prompts_shard_resume_and_answer(tmp_path):
    """--invent: the target writes user messages (starting with the prefix), sharded and resumable
    like responses; a second run answers the user-only file."""
    target = tiny_target_dir(tmp_path / "t", "llama")
    kw = dict(target=target, invent=7, invent_prefix="Write a Python function", temperature=1.0, max_new_tokens=8,
              batch_size=3, seed=2)
    n = regenerate(out=str(tmp_path / "one.jsonl"), **kw).written
    one = _prompts(tmp_path / "one.jsonl")
    assert 0 < n == len(one) <= 7 and all(p.startswith("Write a Python function") for p in one.values())
    assert len(set(one.values())) > 1
    for i in range(2):
        regenerate(out=str(tmp_path / f"s{i}.jsonl"), shard=(i, 2), **kw)
    a, b = _prompts(tmp_path / "s0.jsonl"), _prompts(tmp_path / "s1.jsonl")
    assert not a.keys() & b.keys() and {**a, **b} == one
    assert regenerate(out=str(tmp_path / "one.jsonl"), **kw).written == 0  # resumed: nothing new
    answered = regenerate(out=str(tmp_path / "ans.jsonl"), target=target, prompts=str(tmp_path / "one.jsonl"),
                          max_new_tokens=4, batch_size=4).written
    assert answered == len(one) and len(_records(tmp_path / "ans.jsonl")) == len(one)


def test_invent_refuses_greedy_and_a_prompt_file(tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        regenerate(out=str(tmp_path / "x.jsonl"), target=tiny_target_dir(tmp_path / "t", "llama"), invent=2)
    with pytest.raises(ValueError, match="--prompts"):
        regenerate(out=str(tmp_path / "x.jsonl"), prompts=write_chats(tmp_path / "p.jsonl", 2), invent=2,
                   temperature=1.0)
    assert not (tmp_path / "x.jsonl").exists()


def test_pre_query_text_is_the_template_before_the_user_message(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir(tmp_path / "t", "llama"))
    head = pre_query_text(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert full.startswith(head) and full[len(head):].startswith("hello there") and "hello" not in head


def test_default_data_is_keyed_by_what_decides_it(tmp_path):
    """extract's default data file is named by target, limit, seed and settings: no reuse across them."""
    from extract.config import ExtractConfig
    from extract.run import default_data_path

    a, b = tiny_target_dir(tmp_path / "a", "llama"), tiny_target_dir(tmp_path / "b", "qwen3")
    path = lambda **kw: default_data_path(ExtractConfig(store="s", **{"target": a, **kw}))
    assert path() == path() == path(limit=64)  # 64 is the default limit
    assert len({path(), path(limit=8), path(limit=16), path(seed=1), path(target=b)}) == 5


def test_segments_and_history_keep_system_messages_and_drop_assistant_turns():
    from chat.conversations import history, segments

    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
            {"role": "system", "content": "note"}, {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2"}, {"role": "user", "content": "U3"}, {"role": "assistant", "content": "x"}]
    segs = segments(conv)
    assert [[m["content"] for m in s] for s in segs] == [["S", "U1"], ["note", "U2"], ["U3"]]
    assert [m["content"] for m in history(segs, ["a1", "a2"])] == ["S", "U1", "a1", "note", "U2", "a2", "U3"]
    assert segments(conv, "first") == segs[:1] and segments([{"role": "system", "content": "S"}]) == []
    with pytest.raises(ValueError, match="turns"):
        segments(conv, "last")


def test_every_turn_equals_hf_generate_after_the_regenerated_history(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chat.conversations import history, segments
    from target.loader import chat_ids, eos_ids

    target = tiny_target_dir(tmp_path / "t", "llama")
    prompts = write_chats(tmp_path / "p.jsonl", 4, turns=3)
    res = regenerate(out=str(tmp_path / "o.jsonl"), target=target, prompts=prompts, max_new_tokens=6, batch_size=3)
    assert res.written == 4 and not (tmp_path / "o.jsonl.turns.jsonl").exists()
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = eos_ids(tok, model)
    source = [json.loads(x)["messages"] for x in open(prompts)]
    for line in open(tmp_path / "o.jsonl"):
        r = json.loads(line)
        segs = segments(source[r["prompt_index"]])
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert len(answers) == 3 and r["messages"] == history(segs, answers[:2]) + [r["messages"][-1]]
        for t in range(3):  # each turn: greedy HF generate on the history the run built
            ids = torch.tensor([chat_ids(tok, history(segs, answers[:t]))])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
            assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == answers[t], (r["prompt_index"], t)
    first = regenerate(out=str(tmp_path / "f.jsonl"), target=target, prompts=prompts, max_new_tokens=6, turns="first")
    assert first.written == 4 and all(len(json.loads(x)["messages"]) == 2 for x in open(tmp_path / "f.jsonl"))


def test_multi_turn_resume_goes_on_from_each_conversations_next_turn(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "llama")
    prompts = write_chats(tmp_path / "p.jsonl", 5, turns=2)
    kw = dict(target=target, prompts=prompts, num_samples=2, temperature=0.8, max_new_tokens=5, batch_size=4, seed=3)
    regenerate(out=str(tmp_path / "one.jsonl"), **kw)
    one = {(r["prompt_index"], r["sample"]): r["messages"] for r in map(json.loads, open(tmp_path / "one.jsonl"))}
    assert len(one) == 10
    # a run killed in turn 1: three conversations finished, two with only their first answer logged (one torn)
    cut = tmp_path / "cut.jsonl"
    keep = sorted(one)[:3]
    cut.write_text("".join(json.dumps({"messages": one[j], "prompt_index": j[0], "sample": j[1]}) + "\n" for j in keep))
    half = sorted(one)[3:5]
    from extract.regenerate.turns import conversation_key

    key = {j: conversation_key([m for m in one[j] if m["role"] != "assistant"]) for j in half}
    log = [json.dumps({"key": key[j], "sample": j[1], "turn": 0, "content": one[j][1]["content"]}) for j in half]
    (tmp_path / "cut.jsonl.turns.jsonl").write_text(log[0] + "\n" + log[1][:9])
    assert regenerate(out=str(cut), **kw).written == 7
    got = {(r["prompt_index"], r["sample"]): r["messages"] for r in map(json.loads, open(cut))}
    assert got == one and not (tmp_path / "cut.jsonl.turns.jsonl").exists()


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_one_line(tmp_path):
    from transformers import AutoTokenizer

    from extract.regenerate.config import RegenConfig
    from target.loader import chat_ids

    tok = AutoTokenizer.from_pretrained(tiny_target_dir(tmp_path / "t", "llama"))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}LOUD{% endif %}"
    conv = [{"role": "user", "content": "hi"}]
    cfg = RegenConfig(out=str(tmp_path / "o.jsonl"), chat_template_kwargs='{"shout": true}')
    assert chat_ids(tok, conv, cfg.template_kwargs) == chat_ids(tok, [{"role": "user", "content": "hiLOUD"}])
    assert chat_ids(tok, conv) != chat_ids(tok, conv, cfg.template_kwargs)
    for bad, why in (("{shout: true}", "is not JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=why):
            RegenConfig(out="o.jsonl", chat_template_kwargs=bad)


def test_extraction_renders_with_the_datas_template_options_or_refuses(tmp_path):
    from extract.config import ExtractConfig
    from extract.run import run as extract

    target = tiny_target_dir(tmp_path / "t", "llama")
    out = tmp_path / "d.jsonl"
    regenerate(out=str(out), target=target, prompts=write_chats(tmp_path / "p.jsonl", 3), max_new_tokens=40,
               chat_template_kwargs='{"mode": "brief"}')
    summary = json.loads((tmp_path / "d.jsonl.summary.json").read_text())
    assert summary["chat_template_kwargs"] == {"mode": "brief"} and summary["last_run"]["written"] == 3
    kw = dict(target=target, data=str(out), layers=(0, 2), max_len=256, min_supervised=2, token_budget=1024)
    with pytest.raises(ValueError, match=r"regenerated with chat template options \{\"mode\": \"brief\"\}"):
        extract(ExtractConfig(store=str(tmp_path / "a.zarr"), **kw))
    extract(ExtractConfig(store=str(tmp_path / "b.zarr"), chat_template_kwargs='{"mode": "brief"}', **kw))
    from cache_format import StoreReader

    assert StoreReader(tmp_path / "b.zarr").manifest.extract_config["chat_template_kwargs"] == '{"mode": "brief"}'


def test_two_regenerations_into_one_output_are_refused(tmp_path):
    from cache_format.lock import WriterLock

    out = tmp_path / "o.jsonl"
    with WriterLock(out, what="regeneration output"):
        with pytest.raises(ValueError, match="another run is writing this regeneration output"):
            regenerate(out=str(out), target=tiny_target_dir(tmp_path / "t", "llama"),
                       prompts=write_chats(tmp_path / "p.jsonl", 2), max_new_tokens=2)
    assert not out.exists()


def test_prompts_longer_than_the_context_are_refused_at_once_and_counted(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "llama")  # 512 positions
    prompts = tmp_path / "p.jsonl"
    long = " ".join(["alpha"] * 600)
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": long}]}) + "\n")
    for engine in ("static", "hf"):
        res = regenerate(out=str(tmp_path / f"{engine}.jsonl"), target=target, prompts=str(prompts), max_new_tokens=4,
                         engine=engine)
        assert (res.written, res.too_long, res.failed) == (1, 1, 0), engine


def test_a_reordered_prompt_file_resumes_by_content_not_line(tmp_path):
    # the first run answered 3 of 6 prompts; the file is then reversed and grown: the rerun answers
    # exactly the prompts not yet answered, each once
    target = tiny_target_dir(tmp_path / "t", "llama")
    lines = open(write_chats(tmp_path / "p.jsonl", 6, turns=2)).read().splitlines()
    (tmp_path / "first.jsonl").write_text("\n".join(lines[:3]) + "\n")
    kw = dict(target=target, max_new_tokens=4, batch_size=4)
    out = str(tmp_path / "o.jsonl")
    assert regenerate(out=out, prompts=str(tmp_path / "first.jsonl"), **kw).written == 3
    (tmp_path / "all.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    assert regenerate(out=out, prompts=str(tmp_path / "all.jsonl"), **kw).written == 3
    asked = [tuple(m["content"] for m in json.loads(x)["messages"] if m["role"] == "user") for x in open(out)]
    assert len(asked) == 6 and len(set(asked)) == 6


def test_an_empty_prompt_file_is_an_error_not_zero_written(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no conversation with a user message"):
        regenerate(out=str(tmp_path / "o.jsonl"), prompts=str(tmp_path / "empty.jsonl"), target="unused")


def test_answers_that_repeat_themselves_are_counted(tmp_path, capsys):
    """The closing line and the summary count the written answers that loop (extract.regenerate.loops)."""
    from chat.conversations import segments
    from extract.regenerate.config import RegenConfig
    from extract.regenerate.output_file import write_results as _write
    from extract.regenerate.turns import TurnLog, conversation_key

    convs = [[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]]
    out = tmp_path / "o.jsonl"
    log = TurnLog(out, [conversation_key(c) for c in convs])
    loop = "The first line is long enough.\nThe second line is long enough.\n" * 2
    results = iter([((0, 0), loop, 9, 1), ((1, 0), "Fine.", 2, 1)])
    s = _write(RegenConfig(out=str(out)), out, [segments(c) for c in convs], results, log, set())
    assert (s.written, s.looping) == (2, 1)
    assert "1 answers repeat themselves" in capsys.readouterr().err
    assert [r["messages"][-1]["content"] for r in map(json.loads, out.read_text().splitlines())] == [loop.strip(), "Fine."]


def test_a_rerun_with_other_options_is_refused_and_leaves_the_output_as_it_was(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "llama")
    out = tmp_path / "o.jsonl"
    kw = dict(target=target, prompts=write_chats(tmp_path / "p.jsonl", 3), max_new_tokens=6)
    regenerate(out=str(out), chat_template_kwargs='{"mode": "brief"}', **kw)
    before = (out.read_bytes(), (tmp_path / "o.jsonl.summary.json").read_bytes())
    for other in (dict(chat_template_kwargs='{"mode": "long"}'), dict(chat_template_kwargs="", max_new_tokens=7)):
        with pytest.raises(ValueError, match=r"o.jsonl was made with other options \(chat-template-kwargs"):
            regenerate(out=str(out), **{**kw, **other})
    assert (out.read_bytes(), (tmp_path / "o.jsonl.summary.json").read_bytes()) == before
    # scheduling options may change: a rerun with another batch size goes on (nothing is missing)
    assert regenerate(out=str(out), chat_template_kwargs='{"mode": "brief"}', batch_size=2, **kw).written == 0


def test_sigterm_stops_after_the_last_whole_record_and_a_rerun_goes_on(tmp_path):
    """A scheduler's SIGTERM: the run stops with the shell's code for it (143), the output holds whole
    records only, and the same command again writes exactly what is missing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    target = tiny_target_dir(tmp_path / "t", "llama")
    prompts = write_chats(tmp_path / "p.jsonl", 40)
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "extract.regenerate", "--target", target, "--prompts", prompts, "--out", str(out),
           "--max-new-tokens", "48", "--batch-size", "1"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.05)
    assert p.poll() is None, "regeneration finished before it could be signalled"
    p.send_signal(signal.SIGTERM)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, text
    assert "stopped by SIGTERM" in text and "rerun the same command" in text
    first = _records(out)  # every line whole: json.loads of each
    assert 3 <= len(first) < 40
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = out.read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines: answers may hold U+2028
    done = _records(out)
    assert len(lines) == len(done) == 40 and all(done[k] == v for k, v in first.items())
