"""Command lines built from a stage's config dataclass, the one source of their options.

Every field becomes `--kebab-name` (a bool field `--name/--no-name`), typed by its annotation, with
the field's default and the field's docstring as its help. `--config FILE` (TOML, or YAML for .yaml
and .yml) gives values by field name; flags on the command line win over the file, the file over
the defaults. `--print-config` prints the resolved config as TOML and exits, so a run's flags can
become a file. A bad file is refused in one line that names it (and the line, where TOML says it).
extract, extract.regenerate and train all build their commands here (they share nothing else).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

__all__ = ["config_command", "field_docs", "field_sections", "load_config_file", "to_toml"]


def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring (the string literal under it), whitespace collapsed}."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_sections(cls: type) -> dict[str, str]:
    """{first field of a section: its title}, from the class body's `# ---- title` comment lines:
    the sections `--help` groups the options under."""
    out, title = {}, None
    for line in textwrap.dedent(inspect.getsource(cls)).splitlines():
        text = line.strip()
        if text.startswith("# ----"):
            title = text.lstrip("# -").strip()
        elif title and re.match(r"[a-z_]\w*\s*:", text):
            out[text.split(":")[0].strip()], title = title, None
    return out


class _SectionedCommand(click.Command):
    """A command whose --help lists its options under their config sections."""

    def __init__(self, *args: Any, sections: dict[str, str], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sections = sections

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: list[tuple[str, list[tuple[str, str]]]] = [("Options", [])]
        for param in self.get_params(ctx):
            if param.name in self.sections:
                groups.append((self.sections[param.name][:1].upper()
                               + self.sections[param.name][1:], []))
            record = param.get_help_record(ctx)
            if record:
                groups[-1][1].append(record)
        for title, rows in groups:
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class _Seq(click.ParamType):
    """A tuple field: "1,9,17" (or "0/2" with sep "/") on the command line, a list in a config
    file."""

    def __init__(self, item: type, sep: str) -> None:
        self.item, self.sep = item, sep
        self.name = f"{item.__name__}{sep}..."

    def convert(self, value: Any, param, ctx) -> tuple:
        if isinstance(value, (list, tuple)):
            items = list(value)
        else:  # an empty value is the empty list (the field's "none given")
            items = str(value).split(self.sep) if str(value).strip() else []
        if any(isinstance(x, str) and not x.strip() for x in items):  # "1,,2": a slip, not [1, 2]
            self.fail(f"an empty item in {value!r} (values separated by {self.sep!r})", param, ctx)
        try:
            return tuple(self.item(x.strip() if isinstance(x, str) else x) for x in items)
        except (TypeError, ValueError):
            self.fail(f"expected {self.item.__name__} values separated by {self.sep!r}, got "
                      f"{value!r}", param, ctx)


def load_config_file(path: str, fields: list[str],
                     types: dict[str, Any] | None = None) -> dict[str, Any]:
    """{field: value} of a TOML or YAML file; ValueError in one line naming the file on bad input
    (with `types`, the fields' annotations: a value of another type, such as 1 for a bool, too)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except Exception as e:  # noqa: BLE001 - tomllib and yaml raise their own error types
        raise ValueError(f"{path}: not valid "
                         f"{'YAML' if p.suffix in ('.yaml', '.yml') else 'TOML'}: "
                         f"{' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected key = value pairs at the top level, got a "
                         f"{type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ValueError(f"{path}: unknown key {key!r} (the keys are the options without '--': "
                             f"{', '.join(fields)})")
        if types and name in types and not _fits(value, types[name]):
            want = getattr(types[name], "__name__", str(types[name]))
            raise ValueError(f"{path}: {key} = {value!r} is a {type(value).__name__}; {key} takes "
                             f"a {want}")
        out[name] = value
    return out


def _fits(value: Any, hint: Any) -> bool:
    """Whether a config file's value has the field's type (bool is not an int here, an int is a
    float)."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, (list, tuple))
    return True


def to_toml(values: dict[str, Any]) -> str:
    """Flat TOML of a config's to_dict() (JSON scalars and lists are TOML too; None has no TOML
    form)."""
    return "".join(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}\n"
                   for k, v in values.items() if v is not None)


def _option(field: dataclasses.Field, hint: Any, doc: str, sep: str) -> click.Option:
    flag = "--" + field.name.replace("_", "-")
    required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    default = None if required else (field.default if field.default is not dataclasses.MISSING
                                     else field.default_factory())
    if hint is bool:
        return click.Option([f"{flag}/--no-{flag[2:]}", field.name], default=default,
                            show_default=True, help=doc)
    if typing.get_origin(hint) is tuple:
        kind = _Seq(typing.get_args(hint)[0], sep)
        shown = sep.join(map(str, default)) if default else "none"
        return click.Option([flag, field.name], type=kind, default=default,
                            required=required, help=doc, show_default=shown)
    kind = {int: click.INT, float: click.FLOAT, str: click.STRING}[hint]
    return click.Option([flag, field.name], type=kind, default=default, required=required, help=doc,
                        show_default=default not in ("", None))


def config_command(cls: type, *, seps: dict[str, str] | None = None,
                   extra: tuple[click.Option, ...] = ()):
    """Decorator: `fn(cfg, **extra options)` becomes a click command whose options are cls's fields.

    An invalid config (the dataclass's ValueError) is one line on stderr and exit 2.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields = list(dataclasses.fields(cls))
    names = [f.name for f in fields]

    def load(ctx: click.Context, _param, value: str | None) -> None:
        if not value:
            return
        try:
            values = load_config_file(value, names, hints)
        except ValueError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        # flags given on the command line win
        ctx.default_map = {**(ctx.default_map or {}), **values}

    def deco(fn: Callable[..., Any]) -> click.Command:
        params = [click.Option(["--config"], is_eager=True, expose_value=False, callback=load,
                               type=click.Path(dir_okay=False),
                               help="TOML or YAML file of option values by name (e.g. token_budget "
                                    "= 8192); flags given here override it."),
                  click.Option(["--print-config"], is_flag=True,
                               help="Print the resolved config as TOML and exit.")]
        params += [_option(f, hints[f.name], docs.get(f.name, ""), (seps or {}).get(f.name, ","))
                   for f in fields]
        params += list(extra)

        def callback(print_config: bool, **kw: Any) -> Any:
            try:
                cfg = cls(**{n: kw.pop(n) for n in names})
            except ValueError as e:
                click.echo(f"error: {e}", err=True)
                sys.exit(2)
            if print_config:
                click.echo(to_toml(cfg.to_dict()), nl=False)
                return None
            return fn(cfg, **kw)

        return _SectionedCommand(fn.__name__, params=params, callback=callback, help=fn.__doc__,
                                 context_settings={"max_content_width": 100},
                                 sections=field_sections(cls))

    return deco
