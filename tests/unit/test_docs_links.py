"""Every relative link in README.md and docs/*.md leads somewhere.

A link resolves when its path (relative to the file holding the link) exists and, when it
has an anchor `#...`, the target Markdown file has a heading with that slug under
GitHub's rules: lowercase, punctuation other than '-' and '_' removed, spaces to '-',
repeats suffixed -1, -2, ... Links with a scheme (https:, mailto:) are not checked:
tests run offline.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# [text](target) or ![alt](target), an optional "title"; the text may wrap lines and
# hold one level of brackets.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept): links there are code."""
    out, fence = [], ""
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = ""
            out.append("")
        elif m:
            fence = m.group(1)
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (inline code, links and emphasis as text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    for line in _prose(path.read_text(encoding="utf-8")).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        if n:
            seen.setdefault(f"{base}-{n}", 1)
    return set(seen)


def broken_links(md: Path) -> list[str]:
    """`file:line: target: why` for each relative link in md that does not resolve."""
    text = CODE_SPAN.sub("``", _prose(md.read_text(encoding="utf-8")))
    problems = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (md.parent / unquote(path_part)).resolve() if path_part else md
        line = text.count("\n", 0, m.start()) + 1
        where = f"{md.name}:{line}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def test_the_docs_to_check_are_found():
    assert REPO / "README.md" in DOC_FILES
    assert len(DOC_FILES) > 1, "docs/*.md found nothing"


@pytest.mark.parametrize("md", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_to_a_file_and_heading(md: Path):
    problems = broken_links(md)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slug_follows_github_rules_for_punctuation_code_and_repeats(tmp_path: Path):
    assert slug("Planning a run: `geotrain plan`") == "planning-a-run-geotrain-plan"
    assert slug("Secure aggregation (optional)") == "secure-aggregation-optional"
    assert slug("What is verified here, and what only under mocks") == (
        "what-is-verified-here-and-what-only-under-mocks"
    )
    doc = tmp_path / "a.md"
    doc.write_text("# Notes\n## Measured\n```\n# not a heading\n```\n## Measured\n")
    assert anchors(doc) == {"notes", "measured", "measured-1"}


def test_checker_reports_a_planted_missing_file_and_missing_anchor(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "sync.md").write_text("# Sync\n\n## DiLoCo settings\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "Good: [sync](docs/sync.md#diloco-settings), [top](#front), [web](https://x.org).\n"
        "# Front\n"
        "Bad: [gone](docs/clouds.md) and [wrong\nanchor](docs/sync.md#diloco).\n"
        "```\n[in code](docs/nowhere.md)\n```\n"
    )
    problems = broken_links(readme)
    assert len(problems) == 2, problems
    assert problems[0].startswith("README.md:3: docs/clouds.md: no such file")
    assert problems[1].startswith("README.md:3: docs/sync.md#diloco: no heading")
