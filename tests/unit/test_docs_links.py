"""Every relative link in README.md and docs/*.md points at a path in the repository (and, for a link into a
markdown page with a #fragment, at a heading or an explicit anchor of that page)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found: set[str] = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for h in re.findall(r"^#{1,6} (.+)$", text, re.M):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = CODE.sub("", text)
    return LINK.findall(text)


def broken(page: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or not dest.is_relative_to(root):
            bad.append(f"{target} (no such path)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def test_the_checker_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Top\n[ok](p.md#top) [gone](nowhere.md) [bad](p.md#missing) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.com)\n")
    assert broken(page, tmp_path) == ["nowhere.md (no such path)", "p.md#missing (no such heading)"]


def test_slug_is_githubs() -> None:
    assert slug("Failure handling: when a process dies") == "failure-handling-when-a-process-dies"
    assert slug("Using it: `hetmesh plan`") == "using-it-hetmesh-plan"


def test_every_relative_link_resolves() -> None:
    assert (ROOT / "docs" / "index.md").exists()
    bad = {p.relative_to(ROOT).as_posix(): b for p in pages() if (b := broken(p))}
    assert not bad, bad
