"""Every relative link in the repository's Markdown resolves to a file or folder that exists.

The docs are split over README.md, BENCHMARKS.md, docs/*.md, docs/results/ and docs/benchmarks/;
a page moved or renamed must fail here, not in a reader's click. Links inside fenced code blocks,
to web addresses and to anchors of the same page are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def markdown_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not any(part.startswith(".") or part in ("node_modules", "build", "dist")
                             for part in p.relative_to(ROOT).parts[:-1]))


def broken_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            out.append(f"{path.relative_to(ROOT)}: {target}")
    return out


def test_markdown_files_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in markdown_files()}
    assert {"README.md", "BENCHMARKS.md", "docs/results.md", "docs/benchmarks/overload.md"} <= names


def test_every_relative_markdown_link_resolves() -> None:
    broken = [b for p in markdown_files() for b in broken_links(p)]
    assert not broken, "broken links:\n" + "\n".join(broken)
