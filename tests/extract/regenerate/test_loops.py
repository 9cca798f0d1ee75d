"""Loops in answers: where they start, what is cut, and the tool over a file."""

from __future__ import annotations

import gzip
import json

from click.testing import CliRunner

from extract.regenerate.loops import cut_conversation, loop_start, main

A, B, C = "The first step is to add the numbers.", "Then we divide the sum by two.", "So the answer is 21."


def test_a_recurring_pair_of_lines_starts_a_loop_at_its_second_copy():
    text = f"Intro line here.\n{A}\n{B}\n{C}\n\n{A}\n{B}\n{C}\n{A}\n"
    assert loop_start(text) == text.index(f"\n\n{A}") + 2  # the second copy, after the blank line
    assert text[: loop_start(text)].rstrip() == f"Intro line here.\n{A}\n{B}\n{C}"


def test_single_repeated_lines_short_lines_and_clean_text_are_not_loops():
    assert loop_start(f"{A}\n{B}\n{C}\n{A}\n{C}\n") == len(f"{A}\n{B}\n{C}\n{A}\n{C}\n")  # A recurs, not A-B
    short = "x = 1\ny = 2\nx = 1\ny = 2\n"  # recurring, but under min_chars
    assert loop_start(short) == len(short) and loop_start(short, min_chars=5) == short.index("x = 1", 1)
    assert loop_start("") == 0 and loop_start(A) == len(A)


def test_only_the_last_answer_is_cut():
    looping = f"{A}\n{B}\n{A}\n{B}\n"
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": looping},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": looping + "tail"}]
    new, gone, had = cut_conversation(msgs)
    assert new[1]["content"] == looping and new[3]["content"] == f"{A}\n{B}"
    assert gone == len(looping + "tail") - len(f"{A}\n{B}") and msgs[3]["content"] == looping + "tail"
    assert had == len(looping + "tail")
    assert cut_conversation(msgs[:1]) == (msgs[:1], 0, 0)
    assert cut_conversation(msgs[:2] + [{"role": "user", "content": "q2"}, {"role": "assistant", "content": B}]) \
        == (msgs[:2] + [{"role": "user", "content": "q2"}, {"role": "assistant", "content": B}], 0, len(B))


def test_the_tool_cuts_a_gzipped_file_keeps_other_fields_and_names_a_bad_line(tmp_path):
    recs = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"{A}\n{B}\n{A}\n{B}"}],
             "domain": "math"},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": C}]}]
    src = tmp_path / "d.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(main, ["--data", str(src), "--out", str(out)])
    assert res.exit_code == 0 and "2 conversations, 1 answers cut" in res.output
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert got[0]["domain"] == "math" and got[0]["messages"][1]["content"] == f"{A}\n{B}" and got[1] == recs[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(recs[1]) + "\n{\"messages\": 3}\n")
    res = CliRunner().invoke(main, ["--data", str(bad), "--out", str(tmp_path / "b.jsonl")])
    assert res.exit_code != 0 and f"{bad}:2: not a conversation record" in res.output
    assert not (tmp_path / "b.jsonl").exists() and not (tmp_path / "b.jsonl.partial").exists()
