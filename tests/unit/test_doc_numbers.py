"""Numbers in README.md and docs/*.md that come from a benchmark are the ones its committed
results file holds (issue 35, item 5): a rerun that changes the file, or a doc edited by
hand, fails here until the doc quotes the file again.

The rule, precisely:
- A doc is cut into sections at every heading (`#`) and every paragraph that opens with a
  bold title (`**Sync methods** (...)`), the way docs/benchmarks.md introduces each table.
- A section's sources are the results files it names: `benchmarks/results/NAME.md` (or a
  link to it, or `NAME.md` alone where benchmarks/results holds that file), and
  `benchmarks/NAME.py` when that script saves `benchmarks/results/NAME.md`.
- In a section with sources, every number with a decimal point in a markdown table cell
  (0.752, 0.37, +6.1%, 90.20 ms, 1.72x) must be one of the numbers of its sources, written
  with at most as many decimals: a cell may round a value, never change it. Integers
  (steps, counts, H, 1/468) are not checked: they are mostly settings, not measurements.
- docs/benchmarks.md ("every measured table, with its script and results file") may hold
  no table with such numbers in a section without sources.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NUMBER = re.compile(r"(?<![\w.])[+-]?\d[\d,]*\.\d+")
"""A number with a decimal point (thousands commas allowed), not inside a word or version."""
SECTION = re.compile(r"^(#|\*\*[^*]+\*\*)")
RESULT_REF = re.compile(r"(?<![\w.-])([\w-]+)\.md\b")
"""A file name ending in .md (a source when benchmarks/results holds it)."""
SCRIPT_REF = re.compile(r"benchmarks/([\w-]+)\.py")


def _value(text: str) -> Decimal:
    return Decimal(text.replace(",", "").lstrip("+"))


def sections(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each section (module doc)."""
    out: list[tuple[int, list[str]]] = []
    start, lines = 1, list[str]()
    prev_blank = True
    for n, line in enumerate(text.splitlines(), 1):
        opens = SECTION.match(line) and (line.startswith("#") or prev_blank)
        if opens and lines:
            out.append((start, lines))
            start, lines = n, []
        lines.append(line)
        prev_blank = not line.strip()
    if lines:
        out.append((start, lines))
    return out


def sources(lines: list[str]) -> list[Path]:
    """The results files a section names (module doc)."""
    found: list[Path] = []
    for line in lines:
        names = RESULT_REF.findall(line) + SCRIPT_REF.findall(line)
        for name in (n for n in names if (RESULTS / f"{n}.md").is_file()):
            path = RESULTS / f"{name}.md"
            if path not in found:
                found.append(path)
    return found


def table_numbers(lines: list[str]) -> list[tuple[int, str]]:
    """(line offset, number) of every decimal number in the section's table rows."""
    return [
        (k, m.group())
        for k, line in enumerate(lines)
        if line.lstrip().startswith("|")
        for m in NUMBER.finditer(line)
    ]


def quoted(number: str, values: set[Decimal]) -> bool:
    """Whether `number` is one of `values` as written, or rounded to its decimals."""
    v = _value(number)
    step = Decimal(1).scaleb(v.as_tuple().exponent)  # type: ignore[arg-type]
    return any(
        x.quantize(step, rounding=mode) == v
        for x in values
        if abs(x - v) <= step
        for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN)
    )


def unquoted(doc: Path) -> list[str]:
    """`doc:line: number (sources)` for every checked number its sources do not hold."""
    bad = []
    for start, lines in sections(doc.read_text()):
        files = sources(lines)
        nums = table_numbers(lines)
        if not files:
            if doc.name == "benchmarks.md" and nums:
                bad.append(f"{doc.name}:{start}: a measured table with no results file named")
            continue
        values = {
            _value(m.group()) for f in files if f.is_file() for m in NUMBER.finditer(f.read_text())
        }
        for k, number in nums:
            if not quoted(number, values):
                names = ", ".join(f.name for f in files)
                bad.append(f"{doc.name}:{start + k}: {number} is not in {names}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_table_number_is_in_the_results_file_its_section_names(doc: Path) -> None:
    bad = unquoted(doc)
    assert not bad, "numbers not in their results files:\n" + "\n".join(bad)


def test_the_rule_fails_a_stale_table_and_passes_a_quoted_or_rounded_one(tmp_path: Path) -> None:
    """A section naming benchmarks/topology_exchange.py quoting the older run's 0.37 fails;
    the committed file's 0.752 and 0.20, and 6.1 for a file's 6.09, pass."""
    stale = "**Topology** (`benchmarks/topology_exchange.py`)\n\n| direct | 1.487 | 0.37 |\n"
    fresh = "**Topology** (`benchmarks/topology_exchange.py`)\n\n| pieces | 0.752 | 0.20 |\n"
    rounded = "**Parity** (benchmarks/results/diloco_parity.md)\n\n| H=50 int4 | +6.1% |\n"
    for name, text, ok in (("a.md", stale, False), ("b.md", fresh, True), ("c.md", rounded, True)):
        (tmp_path / name).write_text(text)
        assert (unquoted(tmp_path / name) == []) is ok, name
    assert not quoted("6.2", {Decimal("6.09")}) and quoted("0.98", {Decimal("0.976")})
