"""Completion-format prompts from code records: exact renderings, a parse round trip, and refusals."""

from __future__ import annotations

import ast
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from extract.regenerate.completion import completion_prompt, completion_prompts, wrap_completion

ANSWER = """Here is a function:

```python
import math
from typing import List

def norms(rows: List[List[float]],
          p: int = 2) -> List[float]:
    # one norm per row
    return [sum(abs(x) ** p for x in r) ** (1 / p) for r in rows]

print(norms([[3, 4]]))
```
It prints 5.0."""


def _code(prompt: str) -> str:
    return re.fullmatch(r"Complete the following Python function\.\n\n```python\n(.*)```", prompt, re.S).group(1)


def test_a_prompt_is_the_imports_the_signature_and_the_request_as_docstring():
    req = "Write a Python function `norms` that returns the p-norm of each row of a matrix."
    got = completion_prompt(req, ANSWER)
    assert got == wrap_completion(
        "import math\nfrom typing import List\n\n\n"
        "def norms(rows: List[List[float]],\n          p: int = 2) -> List[float]:\n"
        '    """Returns the p-norm of each row of a matrix.\n    """\n')
    # round trip: with a body the prompt's code parses, and the function documents the request
    tree = ast.parse(_code(got) + "    pass\n")
    fn = tree.body[-1]
    assert isinstance(fn, ast.FunctionDef) and fn.name == "norms" and [a.arg for a in fn.args.args] == ["rows", "p"]
    assert ast.get_docstring(fn).strip() == "Returns the p-norm of each row of a matrix."


def test_long_requests_wrap_and_other_openings_stay():
    req = "How do I use Python to " + "count the words of a long text file and report them " * 4
    code = _code(completion_prompt(req, "```py\ndef count(path):\n    return 0\n```"))
    fn = ast.parse(code + "    pass\n").body[0]
    assert " ".join(ast.get_docstring(fn).split()) == " ".join(req.split()) and all(len(ln) <= 88 for ln in code.splitlines())


@pytest.mark.parametrize("request_, answer", [
    ("Sort a list.", "no code here"),
    ("Sort a list.", "```python\ndef broken(:\n    pass\n```"),
    ("Sort a list.", "```python\nx = 1\n```"),
    ("Sort a list.", "```python\n@cache\ndef f(x):\n    return x\n```"),
    ("Sort a list.", '```python\ndef f(x):\n    """Has one."""\n    return x\n```'),
    ("Sort a list.", "```python\ndef f(x): return x\n```"),
    ("Fix this:\n```python\ndef f(): pass\n```", "```python\ndef f(x):\n    return x\n```"),
    ("", "```python\ndef f(x):\n    return x\n```"),
])
def test_answers_without_a_plain_function_or_requests_with_code_give_none(request_, answer):
    assert completion_prompt(request_, answer) is None


def test_only_code_records_with_a_user_turn_and_an_answer_count():
    good = {"domain": "code", "messages": [{"role": "user", "content": "Add two numbers."},
                                           {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]}
    records = [dict(good, domain="math"), {"domain": "code", "messages": good["messages"][:1]}, good, {"domain": "code"}]
    assert [i for i, _ in completion_prompts(records)] == [2]


def test_the_cli_writes_prompts_and_names_a_bad_line(tmp_path):
    rec = {"domain": "code", "messages": [{"role": "user", "content": "Add two numbers."},
                                          {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]}
    data = tmp_path / "train.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    root = Path(__file__).resolve().parents[3]
    run = lambda d: subprocess.run([sys.executable, "-m", "extract.regenerate.completion", "--data", str(d), "--out",
                                    str(tmp_path / "p.jsonl")], capture_output=True, text=True, cwd=root, timeout=120)
    p = run(data)
    assert p.returncode == 0, p.stderr
    lines = (tmp_path / "p.jsonl").read_text().splitlines()  # the second is a near-duplicate of the first
    assert len(lines) == 1 and "def add(a, b):" in json.loads(lines[0])["messages"][0]["content"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rec) + "\n{not json\n")
    p = run(bad)
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(errors) == 1 and f"{bad}:2: malformed JSON" in errors[0]
    none = tmp_path / "none.jsonl"  # records that parse but give no prompt: an error with the reason, not "0 prompts"
    none.write_text(json.dumps({**rec, "domain": "math"}) + "\n")
    p = run(none)
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(errors) == 1 and "no completion prompt among its 1 records (0 with domain" in errors[0]
