"""Render docs/configuration.md, the cluster-file reference, from libs/hetmesh/config.py.

Every section, field, type and default comes from the msgspec Structs themselves; each field's text is the
comment beside it (on its line, or the comment lines just above it), read from the source with `tokenize`.
tests/unit/test_config_docs.py regenerates the page and compares it with the checked-in one, so a config
change that is not followed by a regeneration fails the suite.

    python ops/config_docs.py           # rewrite docs/configuration.md
    python ops/config_docs.py --check   # exit 1 when docs/configuration.md is stale
"""

from __future__ import annotations

import ast
import enum
import inspect
import io
import sys
import tokenize
from pathlib import Path
from typing import Any

import msgspec

from hetmesh import config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"
SOURCE = Path(inspect.getfile(config))


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment beside the field: the comment lines right above it, then the one on its line."""
    comments: dict[int, str] = {}  # line -> comment text
    own_line: set[int] = set()  # lines holding only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                own_line.add(tok.start[0])
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line in own_line:
                above.insert(0, comments[line])
                line -= 1
            parts = above + ([comments[stmt.lineno]] if stmt.lineno in comments and stmt.lineno not in own_line else [])
            out[(node.name, stmt.target.id)] = " ".join(parts)
    return out


def annotations(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the annotation as written in the source."""
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out[(node.name, stmt.target.id)] = ast.unparse(stmt.annotation)
    return out


def toml_value(v: Any) -> str:
    if isinstance(v, enum.Enum):
        v = v.value
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '""' if not v else f'"{v}"'
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def default_of(f: msgspec.structs.FieldInfo) -> str:
    if f.default is not msgspec.NODEFAULT:
        return f"`{toml_value(f.default)}`"
    if f.default_factory is not msgspec.NODEFAULT:
        made = f.default_factory()
        if isinstance(made, msgspec.Struct):
            return f"see [{type(made).__name__}](#{type(made).__name__.lower()})"
        return f"`{toml_value(made)}`"
    return "required"


def struct_of(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct a field holds, directly or as the items of a list."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    args = getattr(tp, "__args__", ())
    if getattr(tp, "__origin__", None) is list and args and isinstance(args[0], type) and issubclass(args[0], msgspec.Struct):
        return args[0]
    return None


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections() -> list[tuple[str, type[msgspec.Struct]]]:
    """(TOML header, Struct) for every table of a cluster file, depth first from ClusterConfig."""
    out: list[tuple[str, type[msgspec.Struct]]] = [("(top level)", config.ClusterConfig)]

    def walk(cls: type[msgspec.Struct], prefix: str) -> None:
        for f in msgspec.structs.fields(cls):
            sub = struct_of(f.type)
            if sub is None:
                continue
            name = f"{prefix}.{f.name}" if prefix else f.name
            is_list = getattr(f.type, "__origin__", None) is list
            out.append((f"[[{name}]]" if is_list else f"[{name}]", sub))
            walk(sub, name)

    walk(config.ClusterConfig, "")
    return out


def render() -> str:
    source = SOURCE.read_text()
    comments = field_comments(source)
    written = annotations(source)
    lines = [
        "# Configuration: the cluster file",
        "",
        "<!-- GENERATED by ops/config_docs.py from libs/hetmesh/config.py: do not edit by hand; run",
        "     `.venv/bin/python ops/config_docs.py` after changing the config schema. -->",
        "",
        "One TOML file describes a cluster: the bus, the gateway, the scheduler's policy, the models and the",
        "worker groups. Every service reads the same file (`--cluster F`; the default is",
        "[ops/clusters/default.toml](../ops/clusters/default.toml)); an unknown key is refused at load.",
        "Example files: [ops/clusters/](../ops/clusters/).",
        "",
        "## Environment overrides",
        "",
        inspect.cleandoc(config.__doc__ or "").split("\n\n", 1)[-1],
        "",
    ]
    for header, cls in sections():
        anchor = cls.__name__
        lines += [f"## {header}", "", f'<a id="{anchor.lower()}"></a>`{anchor}`' + (
            f": {inspect.cleandoc(cls.__doc__)}" if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(")
            else ""), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in msgspec.structs.fields(cls):
            typ = written.get((cls.__name__, f.name), "")
            text = comments.get((cls.__name__, f.name), "")
            lines.append(f"| `{f.name}` | `{cell(typ)}` | {cell(default_of(f))} | {cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python ops/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
