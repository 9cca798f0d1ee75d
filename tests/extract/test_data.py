"""Chat rendering and loss masks, token by token, and each kind of bad input."""

from __future__ import annotations

import json

import pytest

from extract.data import BadRecord, read_conversations, render
from tests.helpers import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _pieces(tok, r):
    return [(tok.decode([int(i)]), int(m)) for i, m in zip(r.input_ids, r.loss_mask)]


def test_loss_mask_token_by_token(tok):
    msgs = [{"role": "system", "content": "hello"}, {"role": "user", "content": "two plus two"},
            {"role": "assistant", "content": "four"}, {"role": "user", "content": "ten"},
            {"role": "assistant", "content": "eleven"}]
    r = render(0, msgs, tok, max_len=1000)
    text = "".join(p for p, _ in _pieces(tok, r))
    assert text == tok.apply_chat_template(msgs, tokenize=False)
    supervised = "".join(p for p, m in _pieces(tok, r) if m)
    # exactly the assistant contents with their end token (and the template's newline after it)
    assert supervised == "four<|im_end|>\neleven<|im_end|>\n"
    # and every supervised token is inside an assistant turn, every other token outside
    pos, spans = 0, []
    for piece, m in _pieces(tok, r):
        spans.append((pos, pos + len(piece), m))
        pos += len(piece)
    for a, b, m in spans:
        inside = any(text.find(x) <= a < text.find(x) + len(x) for x in ("four<|im_end|>\n", "eleven<|im_end|>\n"))
        assert bool(m) == inside, (text[a:b], m)


def test_truncation(tok):
    msgs = [{"role": "user", "content": "hello " * 30}, {"role": "assistant", "content": "world " * 30}]
    r = render(0, msgs, tok, max_len=20)
    assert r.truncated and len(r.input_ids) == 20 and len(r.loss_mask) == 20


def _write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})


@pytest.mark.parametrize("line,msg", [
    ('{"messages": [', "d.jsonl:2: malformed JSON"),
    ('{"messages": []}', "d.jsonl:2: empty conversation"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "d.jsonl:2: no assistant turn"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "d.jsonl:2: message 0 has unknown role 'wizard'"),
    ('{"text": "x"}', "d.jsonl:2: record has neither"),
    ('[1, 2]', "d.jsonl:2: record is not a JSON object"),
])
def test_bad_records_name_file_and_line(tmp_path, line, msg):
    p = _write(tmp_path, [GOOD, line, GOOD])
    with pytest.raises(BadRecord, match=msg.replace("[", r"\[")):
        list(read_conversations(p, skip_bad=False))
    bad: list[str] = []
    got = list(read_conversations(p, skip_bad=True, bad=bad))
    assert [sid for sid, _ in got] == [0, 2] and len(bad) == 1 and msg in bad[0]


def test_sharegpt(tmp_path):
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    p = _write(tmp_path, [json.dumps(rec)])
    [(sid, msgs)] = list(read_conversations(p, skip_bad=False))
    assert msgs == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_no_chat_template(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(BadRecord, match="no chat template"):
        render(0, [{"role": "assistant", "content": "x"}], t, max_len=10)


def test_prompt_key_is_the_prompt_not_the_answer():
    from extract.data import prompt_key

    q = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    a, b = q + [{"role": "assistant", "content": "4"}], q + [{"role": "assistant", "content": "four"}]
    assert prompt_key(a) == prompt_key(b) == prompt_key(q)
    assert prompt_key(a) != prompt_key([q[1], a[2]])  # the system turn is part of the prompt
    assert prompt_key(a) != prompt_key([q[0], {"role": "user", "content": "2+3?"}, a[2]])
    assert 0 <= prompt_key(a) < 2**63
