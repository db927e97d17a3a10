"""docs/reference/ is what scripts/reference.py makes of the code as it is: a stale page fails.

The pages are made again into a temporary folder, twice with different hash seeds (the order of
a set must never show), and compared with the checked-in ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED_IN = ROOT / "docs" / "reference"
REFRESH = "run `python scripts/reference.py` and commit docs/reference/"

if sys.version_info < (3, 11):  # griffelib, which reads the code, needs 3.11 (the dev extra says so)
    pytest.skip("the reference is made with Python 3.11 or later", allow_module_level=True)


class Made(NamedTuple):
    """One run of the script: the pages it wrote and what it said."""

    pages: dict[str, str]
    returncode: int
    stderr: str


def make(out: Path, hash_seed: str) -> Made:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "scripts/reference.py", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    pages = {p.name: p.read_text(encoding="utf-8") for p in sorted(out.glob("*.md"))}
    return Made(pages, done.returncode, done.stderr)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Made, Made]:
    """The pages made twice at once, under two hash seeds."""
    outs = [tmp_path_factory.mktemp("reference") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(make, outs, ["0", "12345"])
    return first, second


def test_the_checked_in_reference_is_current(made: tuple[Made, Made]) -> None:
    """Every page in docs/reference/ is the one the script makes now, and no page is missing
    or left over."""
    pages = made[0].pages
    assert made[0].returncode == 0, made[0].stderr
    checked_in = {p.name: p.read_text(encoding="utf-8") for p in sorted(CHECKED_IN.glob("*.md"))}
    assert sorted(checked_in) == sorted(pages), f"docs/reference/ has other pages than the code: {REFRESH}"
    stale = [name for name in pages if checked_in[name] != pages[name]]
    assert stale == [], f"stale: {', '.join(stale)}: {REFRESH}"


def test_every_public_name_has_a_docstring(made: tuple[Made, Made]) -> None:
    """Each name of a public module's `__all__`, and each public method and property of its
    classes, has a docstring (the script names those without one, and fails)."""
    assert made[0].stderr == ""
    assert made[0].returncode == 0


def test_the_pages_are_deterministic_and_name_no_machine(made: tuple[Made, Made]) -> None:
    """The same code makes the same pages whatever the hash seed, with no memory address and no
    path of this machine in them; each public module has its page."""
    first, second = made
    assert first.pages == second.pages
    text = "\n".join(first.pages.values())
    assert str(ROOT) not in text and "/home/" not in text and "/tmp/" not in text
    assert not re.search(r"\b0x[0-9a-f]{6,}\b", text), "a memory address"
    public = ("", ".sinks", ".ray", ".distributed", ".rollouts", ".adapters", ".adapters.trl_adapter")
    for module in (f"asynctrace{m}" for m in (*public, ".testing", ".exceptions", ".view")):
        assert f"{module}.md" in first.pages
        assert f"]({module}.md)" in first.pages["index.md"]


def test_a_page_documents_its_modules_names_from_their_docstrings(made: tuple[Made, Made]) -> None:
    """A name is documented on the page of the module nearest its definition, with its real
    signature, and linked from the other modules that export it."""
    pages = made[0].pages
    sinks, top = pages["asynctrace.sinks.md"], pages["asynctrace.md"]
    assert "## `ParquetSink`" in sinks and "## `ParquetSink`" not in top
    assert "[`ParquetSink`](asynctrace.sinks.md#parquetsink)" in top
    # Watch takes its arguments by position or keyword: no `*` (docs/api.md once showed one).
    watch = top.split("## `Watch`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert watch.startswith("class Watch(") and "*" not in watch
    assert "max_per_step: int = 16" in watch
