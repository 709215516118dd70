"""docs/benchmarks.md is one page of current figures; the history is in docs/benchmarks/, one append-only log per
topic, whose entries code and docs cite by file and anchor. These tests keep every such citation resolvable and the
page short."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
LOGS = ROOT / "docs" / "benchmarks"

# "A few screens": five screens of 50 lines. Past that the page is turning back into a log.
MAX_PAGE_LINES = 250

# Where citations live (the repository's sources, docs, tests and results), not build outputs or venvs.
SCANNED = ["README.md", "Makefile", ".ci", "docs", "operator", "trainer_image", "e2e", "bench", "tests", "scripts",
           "charts", "examples"]
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}

# A path from the repository root to the page or to a log, with or without an anchor.
REPO_PATH_REF = re.compile(r"docs/benchmarks(?:/[A-Za-z0-9_-]+)?\.md(?:#[A-Za-z0-9_-]+)?")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
EXPLICIT_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def markdown_lines(path: Path) -> list[str]:
    """The lines of a markdown file outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def explicit_anchors(path: Path) -> list[str]:
    """The ids of <a id=...> tags, not counting those quoted in `code`."""
    return [a for line in markdown_lines(path) for a in EXPLICIT_ANCHOR.findall(CODE_SPAN.sub("", line))]


@functools.cache
def anchors(path: Path) -> list[str]:
    """Every anchor of a markdown file: explicit <a id=...> and headings' slugs (GitHub numbers repeats -1, -2)."""
    found, seen = explicit_anchors(path), {}
    for line in markdown_lines(path):
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            repeat = seen.get(slug, 0)
            seen[slug] = repeat + 1
            found.append(slug if repeat == 0 else f"{slug}-{repeat}")
    return found


def unresolved(target: Path, anchor: str | None) -> str | None:
    """Why a reference to target#anchor does not resolve, or None."""
    if not target.is_file():
        return "no such file"
    if anchor and anchor not in anchors(target):
        return f"no anchor {anchor!r} in {target.relative_to(ROOT)}"
    return None


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        top = ROOT / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        files += [p for p in candidates
                  if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts) and p.stat().st_size < 5_000_000]
    return files


def repo_path_references() -> list[tuple[str, int, str]]:
    """(file, line, reference) for every docs/benchmarks...md reference written as a path from the root."""
    refs = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="ignore")
        for number, line in enumerate(text.splitlines(), start=1):
            refs += [(str(path.relative_to(ROOT)), number, m.group(0)) for m in REPO_PATH_REF.finditer(line)]
    return refs


def in_benchmark_docs(path: Path) -> bool:
    return path == PAGE or LOGS in path.parents


def markdown_links_into_benchmarks() -> list[tuple[str, int, Path, str | None]]:
    """(file, line, target, anchor) for every relative markdown link, in any scanned markdown file, that lands on
    docs/benchmarks.md or a file under docs/benchmarks/ (a bare #anchor counts when the file is one of them)."""
    links = []
    for source in [p for p in scanned_files() if p.suffix == ".md"]:
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
            for href in MARKDOWN_LINK.findall(line):
                if re.match(r"[a-z]+:", href):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = href.partition("#")
                target = (source.parent / file_part).resolve() if file_part else source.resolve()
                if in_benchmark_docs(target):
                    links.append((str(source.relative_to(ROOT)), number, target, anchor or None))
    return links


def test_every_path_reference_to_the_benchmark_docs_resolves():
    refs = repo_path_references()
    assert len(refs) >= 20, "the scan found almost no references: is SCANNED still right?"
    broken = []
    for where, number, ref in refs:
        file_part, _, anchor = ref.partition("#")
        why = unresolved(ROOT / file_part, anchor or None)
        if why:
            broken.append(f"{where}:{number}: {ref}: {why}")
    assert not broken, "\n".join(broken)


def test_every_markdown_link_into_the_benchmark_docs_resolves():
    links = markdown_links_into_benchmarks()
    assert len(links) >= 20, "the page links its figures to the logs; the scan found almost none"
    broken = [f"{where}:{number}: {target.relative_to(ROOT)}#{anchor}: {why}"
              for where, number, target, anchor in links if (why := unresolved(target, anchor))]
    assert not broken, "\n".join(broken)


def test_a_reference_to_a_missing_anchor_or_file_is_caught():
    page_anchor = anchors(PAGE)[0]
    assert unresolved(PAGE, page_anchor) is None
    assert unresolved(PAGE, "no-such-anchor") is not None
    assert unresolved(LOGS / "no-such-topic.md", None) == "no such file"


@pytest.mark.parametrize("heading, slug", [
    ("Create-only CEL rules", "create-only-cel-rules"),
    ("Hugging Face import and export (issue 27, 2026-11-24 UTC)", "hugging-face-import-and-export-issue-27-2026-11-24-utc"),
    ("CI: `.ci/run` (= `make test`) on a clean clone", "ci-cirun--make-test-on-a-clean-clone"),
])
def test_heading_slugs_are_githubs(heading, slug):
    assert github_slug(heading) == slug


def test_the_page_of_current_figures_stays_a_few_screens():
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_PAGE_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {MAX_PAGE_LINES}): it is a page of current figures, "
        "one row per measure; the history goes in the topic's log in docs/benchmarks/")


def test_every_log_is_listed_on_the_page_and_says_it_is_append_only():
    page = PAGE.read_text(encoding="utf-8")
    logs = sorted(LOGS.glob("*.md"))
    assert logs
    for log in logs:
        assert f"](benchmarks/{log.name})" in page, f"docs/benchmarks.md does not list {log.name}"
        top = "\n".join(log.read_text(encoding="utf-8").splitlines()[:12])
        assert "Append-only, newest last" in top, f"{log.name} does not say at its top that it is append-only"


def test_explicit_anchors_are_unique_in_each_file():
    for path in [PAGE, *LOGS.glob("*.md")]:
        found = explicit_anchors(path)
        repeated = sorted({a for a in found if found.count(a) > 1})
        assert not repeated, f"{path.relative_to(ROOT)}: <a id> {repeated} appear more than once"
