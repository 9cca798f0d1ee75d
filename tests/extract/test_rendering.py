"""Chat rendering and loss masks, token by token, and each kind of bad input."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extract.rendering import BadRecord, read_conversations, render, render_many
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


def test_render_many_in_processes_equals_render_one_by_one(tok):
    """The spawned-process path gives what render gives, record by record and in order, and hands
    back a record's error in its place."""
    records = [(i, [{"role": "user", "content": f"question {i} " * (i % 5 + 1)},
                    {"role": "assistant", "content": f"answer {i} " * (i % 7 + 1)}]) for i in range(12)]
    got = render_many(records, tok, max_len=40, processes=2, min_parallel=0)
    assert len(got) == len(records)
    for (sid, msgs), r in zip(records, got):
        want = render(sid, msgs, tok, max_len=40)
        assert (r.sample_id, r.truncated, r.prompt_key) == (want.sample_id, want.truncated, want.prompt_key)
        assert r.input_ids.tolist() == want.input_ids.tolist() and r.loss_mask.tolist() == want.loss_mask.tolist()
    assert any(r.truncated for r in got) and not all(r.truncated for r in got)
    # a record that cannot be rendered comes back as its error, in its place
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    errors = render_many(records[:2], bare, max_len=40, processes=2, min_parallel=0)
    with pytest.raises(BadRecord) as want_error:
        render(0, records[0][1], bare, max_len=40)
    assert [str(e) for e in errors] == [str(want_error.value)] * 2


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
    ('{"messages": "hello"}', "d.jsonl:2: 'messages' must be a list of messages, got str"),
    ('{"messages": [{"role": "user", "content": "\\ud800 x"}, {"role": "assistant", "content": "y"}]}',
     "d.jsonl:2: message 0 holds a lone surrogate"),
    ('{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}',
     "d.jsonl:2: message 0 is an empty user turn"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
     '{"role": "user", "content": " \\n "}, {"role": "assistant", "content": "c"}]}',
     "d.jsonl:2: message 2 is an empty user turn"),
])
def test_bad_records_name_file_and_line(tmp_path, line, msg):
    p = _write(tmp_path, [GOOD, line, GOOD])
    with pytest.raises(BadRecord, match=msg.replace("[", r"\[")):
        list(read_conversations(p, skip_bad=False))
    bad: list[str] = []
    got = list(read_conversations(p, skip_bad=True, bad=bad))
    assert [sid for sid, _ in got] == [0, 2] and len(bad) == 1 and msg in bad[0]


def test_invalid_utf8_is_one_named_bad_record(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n' + GOOD.encode() + b"\n")
    with pytest.raises(BadRecord, match=r"d.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        list(read_conversations(p, skip_bad=False))
    bad: list[str] = []
    assert [sid for sid, _ in read_conversations(p, skip_bad=True, bad=bad)] == [0, 2] and len(bad) == 1


def test_a_gzipped_file_reads_as_the_plain_one_and_a_damaged_one_is_named(tmp_path):
    import gzip

    from chat.conversations import jsonl_records

    plain = _write(tmp_path, [GOOD, "", GOOD.replace("\"b\"", "\"c\"")])
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert list(read_conversations(packed, skip_bad=False)) == list(read_conversations(plain, skip_bad=False))
    assert [i for i, _ in jsonl_records(packed)] == [0, 2]
    torn = tmp_path / "torn.jsonl.gz"
    torn.write_bytes(packed.read_bytes()[:-12])  # cut inside the gzip trailer
    with pytest.raises(BadRecord, match=r"torn.jsonl.gz: not a readable gzip file"):
        list(read_conversations(torn, skip_bad=True))
    with pytest.raises(BadRecord, match=r"d.jsonl:2: record is not a JSON object"):
        list(jsonl_records(_write(tmp_path, [GOOD, "[1]"])))


def test_a_byte_order_mark_opens_the_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n")
    assert len(list(read_conversations(p, skip_bad=False))) == 1


_PIECES = ['{', '}', '[', ']', '"', ':', ',', 'messages', 'role', 'content', 'user', 'assistant', 'conversations',
           'from', 'value', 'gpt', '\\u', 'd800', '\\ud83d', 'null', '1', 'true', ' ', '\\', 'x']


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_corruption_of_a_record_is_one_named_bad_record_or_a_conversation(tmp_path_factory, data):
    """Random edits of valid records (bytes cut, inserted, replaced; invalid UTF-8 too): the reader and
    the renderer either give a conversation or raise BadRecord naming file and line, never another
    exception; --skip-bad skips exactly the bad lines."""
    tok = tiny_tokenizer()
    line = bytearray(json.dumps({"messages": [{"role": "user", "content": "two plus two"},
                                              {"role": "assistant", "content": "four"}]}).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(line)))
        op = data.draw(st.sampled_from(["cut", "insert", "replace", "byte"]))
        if op == "cut":
            del line[i: i + data.draw(st.integers(1, 6))]
        elif op == "insert":
            line[i:i] = data.draw(st.sampled_from(_PIECES)).encode()
        elif op == "replace" and i < len(line):
            line[i: i + 1] = data.draw(st.sampled_from(_PIECES)).encode()
        else:
            line[i:i] = bytes([data.draw(st.integers(0x80, 0xFF))])
    line = bytes(line).replace(b"\n", b" ")
    p = tmp_path_factory.mktemp("fuzz") / "d.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + line + b"\n" + GOOD.encode() + b"\n")
    try:
        for sid, msgs in read_conversations(p, skip_bad=False):
            render(sid, msgs, tok, max_len=64)
    except BadRecord as e:
        assert str(e).startswith(f"{p}:2: ") and "\n" not in str(e)
    bad: list[str] = []
    got = [sid for sid, _ in read_conversations(p, skip_bad=True, bad=bad)]
    assert got == [0, 2] if bad else got == [0, 1, 2]


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
