"""The packaged held-out prompts split into the evaluation's test (the first 16 of each domain) and
a validation set that shares none of them; `python -m chat prompts` writes either."""

from __future__ import annotations

import json
from collections import Counter

from click.testing import CliRunner

from chat.__main__ import cli
from chat.conversations import prompt_key, read_conversations
from chat.prompts import (
    TEST_PER_DOMAIN,
    domain_of,
    evaluation_prompts,
    heldout_domains,
    heldout_prompts,
    validation_prompts,
)


def test_the_validation_set_is_the_held_out_set_less_the_test():
    test = [name for name, _ in evaluation_prompts()[: 3 * TEST_PER_DOMAIN]]
    assert Counter(domain_of(n) for n in test) == {"math": TEST_PER_DOMAIN, "code": TEST_PER_DOMAIN,
                                                  "chat": TEST_PER_DOMAIN}
    val = [name for name, _ in validation_prompts()]
    every = [name for name, _ in heldout_prompts()]
    assert not set(val) & set(test) and sorted(val + test) == sorted(every) and len(set(every)) == len(every)
    for dom in ("math", "code", "chat"):  # the test is each domain's first prompts: the rest validate
        mine = [n for n in every if domain_of(n) == dom]
        assert [n for n in test if domain_of(n) == dom] == mine[:TEST_PER_DOMAIN]
        even = [n for n, _ in validation_prompts(32) if domain_of(n) == dom]
        assert even == mine[TEST_PER_DOMAIN:TEST_PER_DOMAIN + 32]


def test_the_cli_writes_a_set_that_regeneration_reads(tmp_path):
    from train.eval import _prompts

    out = tmp_path / "val.jsonl"
    res = CliRunner().invoke(cli, ["prompts", "validation", str(out)])
    assert res.exit_code == 0 and f"{len(validation_prompts())} validation prompts" in res.output
    convs = read_conversations(str(out), skip_bad=False, require_assistant=False)
    assert [m for _, m in convs] == [m for _, m in validation_prompts()]
    assert [json.loads(x)["name"] for x in out.read_text().splitlines()] == [n for n, _ in validation_prompts()]
    assert [n for n, _ in _prompts("validation", 0)] == [n for n, _ in validation_prompts()]
    assert _prompts("default", 48) == evaluation_prompts()[:48]
    res = CliRunner().invoke(cli, ["prompts", "validation", str(out), "--per-domain", "32"])
    assert res.exit_code == 0 and "96 validation prompts" in res.output and len(out.read_text().splitlines()) == 96
    res = CliRunner().invoke(cli, ["prompts", "train", str(out), "--per-domain", "3"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "--per-domain" in res.output


def test_a_prompt_key_names_its_held_out_domain():
    val = validation_prompts(2)
    answered = [m + [{"role": "assistant", "content": "an answer"}] for _, m in val]  # keys ignore the answer
    stranger = [{"role": "user", "content": "a prompt of no evaluation"}]
    keys = [prompt_key(m) for m in answered + [stranger]]
    assert heldout_domains(keys) == [domain_of(n) for n, _ in val] + [""]
    assert heldout_domains(keys)[:6] == ["math", "math", "code", "code", "chat", "chat"]
