"""Every relative link of README.md and docs/*.md reaches a file of the repository, and a
`#anchor` reaches a heading of that page; every docs page is reached from the README."""

from __future__ import annotations

from pathlib import Path

from tests.docs.doc_pages import ROOT, anchors, links, pages, rel


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists() or ROOT not in dest.parents:
            bad.append(f"{rel(page)}: {target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{rel(page)}: {target} (no heading #{anchor} in {rel(dest)})")
    return bad


def test_every_relative_link_resolves():
    assert [b for p in pages() for b in broken_links(p)] == []


def test_every_docs_page_is_reached_from_the_readme():
    readme = ROOT / "README.md"
    reached = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme)}
    index = ROOT / "docs" / "index.md"
    reached |= {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    assert index in reached
    assert [rel(p) for p in pages()[1:] if p not in reached] == []


def test_the_link_check_sees_a_broken_link_and_a_missing_anchor(tmp_path: Path, monkeypatch):
    """The checker itself: a page with one good and two bad links."""
    import tests.docs.test_links as me

    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A heading, with: punctuation\n")
    page.write_text(
        "[ok](other.md#a-heading-with-punctuation) [gone](missing.md) [no](other.md#nope)\n"
        "`[in code](missing.md)`\n\n```bash\necho [x](missing.md)\n```\n"
    )
    monkeypatch.setattr(me, "ROOT", tmp_path)
    monkeypatch.setattr(me, "rel", lambda p: p.name)
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nope (no heading #nope in other.md)",
    ]
