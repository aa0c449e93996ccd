"""The user-facing documentation: README.md and docs/*.md, read as Markdown pages (fenced code
blocks, links, heading anchors). Shared by the link and command tests."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = ("bash", "sh", "console")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def blocks(page: Path) -> list[Block]:
    """Every fenced code block, with its language (possibly empty), in page order."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, start, body = len(m.group(1)), m.group(2), m.group(3), i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i].lstrip())
            i += 1
        out.append(Block(page, start + 1, lang, "\n".join(body)))
        i += 1
    return out


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code (links there are not links)."""
    text, lines = page.read_text(), page.read_text().splitlines()
    for b in blocks(page):
        n = b.text.count("\n") + 3
        for k in range(b.line - 1, min(b.line - 1 + n, len(lines))):
            lines[k] = ""
    text = "\n".join(lines)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in prose(page).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, in order."""
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(page))
