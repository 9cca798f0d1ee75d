"""Code-completion prompts (HumanEval's format) made from a recipe's code requests and answers.

HumanEval gives a function's signature and docstring and asks for the body; the recipe's code
prompts are requests in prose ("Write a Python function that ..."), so a drafter trained on the
recipe meets the completion format first at evaluation: on the CPU VM the same drafter decoded the
recipe's code prompts at τ 3.59 and HumanEval's at 2.79
(docs/benchmarks/2026-12-02_data-gap_h200.md). Every record whose answer defines a function gives
one prompt in the evaluation's wrapper: the imports and the signature of the answer's first
top-level function, the request as its docstring. Answered again by the target (`python -m
extract.regenerate --prompts`), they add completion-format samples of the target's own making; none
is a HumanEval problem, and the held-out check of the recipe (near-duplicates of any evaluation
prompt are dropped) is applied to them too.

    python -m extract.regenerate.completion --data train.jsonl.gz --out completion_prompts.jsonl
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import click

from chat.conversations import BadRecord, jsonl_records
from extract.regenerate.dedup import out_options, write_prompts

__all__ = ["completion_prompt", "completion_prompts", "wrap_completion"]

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
# "Write a Python function that returns ..." -> "Returns ...": HumanEval's docstrings describe
_ASK = re.compile(r"^(?:please\s+)?(?:write|implement|create|make)\s+an?\s+(?:python\s+)?"
                  r"(?:function|program|script)(?:\s+`[^`\n]*`)?(?:\s+(?:that|which|to))?\s+", re.I)


def wrap_completion(code: str) -> str:
    """A completion prompt as the evaluation words HumanEval's (chat.prompts)."""
    return f"Complete the following Python function.\n\n```python\n{code}```"


def _head(block: str) -> str | None:
    """The imports and the first top-level function's signature of a code block, or None."""
    try:
        tree = ast.parse(block)
    except (SyntaxError, ValueError):
        return None
    lines = block.splitlines()
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    fn = next((n for n in tree.body if isinstance(n, defs)), None)
    if fn is None or fn.decorator_list or fn.body[0].lineno <= fn.lineno:
        return None  # no function, a decorated one, or a one-line body beside the def
    first = fn.body[0]
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return None  # it has a docstring of its own: the request would be a second one
    imports = [ast.get_source_segment(block, n) for n in tree.body
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    head = lines[fn.lineno - 1: first.lineno - 1]
    while head and (not head[-1].strip() or head[-1].strip().startswith("#")):
        head.pop()  # comments and blank lines between the def and its body
    signature = "\n".join(head).rstrip()
    if not signature.endswith(":"):
        return None  # a comment after the colon, or something stranger: not worth the guess
    return ("\n".join(imports) + "\n\n\n" if imports else "") + signature + "\n"


def completion_prompt(request: str, answer: str) -> str | None:
    """The completion-format prompt for one code record, or None when the answer gives no plain
    function (no fenced block that parses, no top-level function, a decorated or documented one)
    or the request holds code of its own."""
    request = request.strip()
    if not request or "```" in request or '"""' in request:
        return None
    for block in _BLOCK.findall(answer):
        head = _head(block)
        if head is not None:
            what = _ASK.sub("", request, count=1)
            what = what[:1].upper() + what[1:]
            doc = textwrap.fill(what, width=88, initial_indent='    """', subsequent_indent="    ")
            return wrap_completion(f'{head}{doc}\n    """\n')
    return None


def completion_prompts(records: Iterable[dict]) -> Iterator[tuple[int, str]]:
    """(record index, prompt) for each code record (domain "code", a user turn then an answer) that
    gives one."""
    for i, r in enumerate(records):
        msgs = r.get("messages") or []
        if r.get("domain") != "code" or len(msgs) < 2 or msgs[0].get("role") != "user":
            continue
        prompt = completion_prompt(str(msgs[0].get("content", "")),
                                   str(msgs[-1].get("content", "")))
        if prompt is not None:
            yield i, prompt


def _records(path: Path) -> Iterator[dict]:
    try:
        for _, rec in jsonl_records(path):
            yield rec
    except BadRecord as e:
        raise click.ClickException(str(e)) from None


@click.command()
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A recipe's train.jsonl (or .jsonl.gz): records with a domain and messages.")
@out_options
def main(data: Path, out: Path, limit: int) -> None:
    """Completion-format code prompts from a recipe's code records."""
    records = list(_records(data))
    found = [p for _, p in completion_prompts(records)]
    if not found:  # else an empty output and "0 prompts" with exit 0
        code = sum(r.get("domain") == "code" for r in records)
        raise click.ClickException(f"{data}: no completion prompt among its {len(records)} records "
                                   f"({code} with domain \"code\"; a prompt needs a user turn and "
                                   "an answer whose fenced block holds a plain top-level function)")
    kept, dropped = write_prompts(found, out, limit)
    click.echo(f"{kept} completion prompts into {out} ({len(found)} found, {dropped} "
               "near-duplicates dropped)")


if __name__ == "__main__":
    main()
