"""Every relative link in docs/ and README.md, and every docs/ page the code names, resolves.

A link's file must exist in the repository, and its `#anchor` must be one GitHub gives a heading
of that page (lower case, punctuation dropped, spaces as hyphens, `-1`, `-2` after repeats).
Moving a section to another page is where links rot: this names each one left behind.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# Where the code names a docs page in comments, docstrings, messages and tests.
CODE = sorted(
    path
    for folder in ("asynctrace", "tests", "benchmarks", "scripts", "examples")
    for path in (ROOT / folder).rglob("*.py")
)
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
# `docs/<page>.md#anchor`, or `docs/<page>.md, "Section"` (or *Section*): a section the code names.
_CODE_DOCS = re.compile(r"(?<![\w/.-])docs/([\w/.-]+\.md)(#[\w-]+)?(?:,? \(?[\"*]([^\"*]+)[\"*])?")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered from 1, with code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without formatting, lower case, punctuation
    dropped (letters, digits, `_` and `-` kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*{1,3})(.+?)\1", r"\2", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor GitHub gives `page`: one per heading (repeats numbered), and `<a id=...>`."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    text = page.read_text(encoding="utf-8")
    fenced = False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(_HTML_ID.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


@cache
def sections(page: Path) -> frozenset[str]:
    """What the code may name a part of `page` by: its headings, and the bold words that open a
    paragraph or a list item (`**Idempotency.**`), as slugs."""
    leads = re.findall(r"^(?:- )?\*\*([^*]+?)\.?\*\*", page.read_text(encoding="utf-8"), re.MULTILINE)
    return anchors(page) | {slug(lead) for lead in leads}


def broken(source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, does not resolve; None when it does."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    path_part, _, fragment = target.partition("#")
    path = (source.parent / path_part).resolve() if path_part else source
    if not path.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not path.exists():
        return f"{target}: no such file"
    if fragment and path.suffix == ".md" and fragment not in anchors(path):
        return f"{target}: {path.relative_to(ROOT)} has no heading with that anchor"
    return None


def test_the_slugs_follow_githubs_rules() -> None:
    """Headings become anchors as GitHub makes them, repeats numbered."""
    assert slug('What "written" means') == "what-written-means"
    assert slug("A `.wandb` file the sink cannot read") == "a-wandb-file-the-sink-cannot-read"
    assert slug("Tiered capture: a selection per sink") == "tiered-capture-a-selection-per-sink"
    assert slug("`asynctrace recover`") == "asynctrace-recover"
    assert slug("`TraceSession.log_samples_nowait`") == "tracesessionlog_samples_nowait"
    assert slug("[Sinks](sinks.md) and **more**") == "sinks-and-more"
    assert slug("Steps, stragglers and the watch list") == "steps-stragglers-and-the-watch-list"


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    """Each `[text](target)` of README.md and docs/ (reference pages included) leads to a file
    of the repository, and to a heading of it where it names an anchor."""
    assert len(PAGES) > 20
    problems = []
    for page in PAGES:
        for number, line in prose_lines(page.read_text(encoding="utf-8")):
            for match in _LINK.finditer(line):
                why = broken(page, match.group(2))
                if why:
                    problems.append(f"{page.relative_to(ROOT)}:{number}: {why}")
    assert problems == []


def test_every_docs_page_the_code_names_exists() -> None:
    """A comment, docstring, message or test that names a docs page (`docs/sinks.md`, with an
    `#anchor` or a quoted section name or neither) names a page that is there, and a heading of it."""
    problems = []
    for source in CODE:
        for number, line in enumerate(source.read_text(encoding="utf-8").split("\n"), 1):
            for match in _CODE_DOCS.finditer(line):
                target, section = match.group(1) + (match.group(2) or ""), match.group(3)
                why = broken(ROOT / "docs" / "index.md", target)
                if (
                    why is None
                    and section
                    and not any(a.startswith(slug(section)) for a in sections(ROOT / "docs" / match.group(1)))
                ):
                    why = f"{target}: no section {section!r}"
                if why:
                    problems.append(f"{source.relative_to(ROOT)}:{number}: docs/{why}")
    assert problems == []


def test_a_moved_anchor_is_found() -> None:
    """The check names a link whose page is gone, and one whose section moved away."""
    page = ROOT / "docs" / "index.md"
    assert broken(page, "sinks.md#tiered-capture-a-selection-per-sink") is None
    assert broken(page, "no-such-page.md") == "no-such-page.md: no such file"
    assert "no heading with that anchor" in str(broken(page, "index.md#no-such-section"))
    assert "outside the repository" in str(broken(page, "../../x.md"))
