"""The house rules of imports, read from every module's source (imports inside functions included):
the two stages never import each other, the store package imports no other package of the project,
the packages both stages share (target, chat, runtime) import neither stage, nothing but the
`draftcache` command imports it, and training (all of
train/ but evaluation) never reaches the target loader, not even through another module of train/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cache_format", "extract", "train", "target", "chat", "runtime", "draftcache")
SHARED = ("target", "chat", "runtime")
# train's modules that decode with the real target: the only ones that may load it
EVALUATION = {"train.eval", "train.eval_report", "train.acceptance", "train.spec_decode"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str) -> set[str]:
    """The dotted names a module's source imports (absolute, relative ones resolved against `module`)."""
    out: set[str] = set()
    package = module.rsplit(".", 1)[0] if "." in module else module
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def project_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (names that are not modules, e.g. functions, dropped)."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    mods = {_module(p): p for p in files}
    return {m: {n for n in imports_of(p.read_text(), m) if n in mods} for m, p in mods.items()}


def reaches(graph: dict[str, set[str]], start: str, within: str) -> set[str]:
    """Every module `start` imports, following only the modules under `within`."""
    seen, todo = set(), [start]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                if n.startswith(within):
                    todo.append(n)
    return seen


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        top = m.split(".")[0]
        for d in deps:
            other = d.split(".")[0]
            if {top, other} == {"extract", "train"}:
                bad.append(f"{m} imports {d}: the stages never import each other")
            if top == "cache_format" and other != "cache_format":
                bad.append(f"{m} imports {d}: the store package imports no other package of the project")
            if top in SHARED and other in ("extract", "train"):
                bad.append(f"{m} imports {d}: code both stages share imports neither stage")
            if other == "draftcache" and top != "draftcache":
                bad.append(f"{m} imports {d}: only the command imports the command (draftcache names the stages)")
        if top == "train" and m not in EVALUATION:
            bad += [f"{m} reaches {d}: training never loads the target" for d in reaches(graph, m, "train.")
                    if d.startswith("target.")]
    return sorted(bad)


def test_the_project_keeps_its_import_rules():
    assert violations(project_graph()) == []


@pytest.mark.parametrize("extra,expected", [
    ({"extract.run": {"train.data"}}, "the stages never import each other"),
    ({"train.data": {"extract.plan"}}, "the stages never import each other"),
    ({"cache_format.reader": {"target.loader"}}, "the store package imports no other package"),
    ({"chat.prompts": {"train.data"}}, "code both stages share imports neither stage"),
    ({"train.eval": {"draftcache.command"}}, "only the command imports the command"),
    ({"train.losses": {"train.spec_decode"}, "train.spec_decode": {"target.loader"}}, "training never loads the target"),
])
def test_each_rule_catches_its_breach(extra, expected):
    graph = {m: set(d) for m, d in project_graph().items()}
    for m, deps in extra.items():
        graph.setdefault(m, set()).update(deps)
    assert any(expected in v for v in violations(graph))


def test_relative_imports_resolve_against_the_package():
    assert {"train.draft_tree", "train.draft_tree.build_tree"} <= imports_of(
        "from .draft_tree import build_tree", "train.decoding_state")
