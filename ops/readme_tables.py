"""Regenerate the generated tables of the docs (between <!-- BEGIN x --> / <!-- END x --> marks): the subject
table in docs/architecture.md.

    python ops/readme_tables.py          # rewrite docs/architecture.md in place
The test suite checks that the docs' subject table is the code's table.
"""

from __future__ import annotations

import re
from pathlib import Path

from hetmesh import subjects

README = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def replace_block(text: str, name: str, body: str) -> str:
    pat = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main() -> None:
    text = README.read_text()
    text = replace_block(text, "subjects", subjects.markdown_table())
    README.write_text(text)


if __name__ == "__main__":
    main()
