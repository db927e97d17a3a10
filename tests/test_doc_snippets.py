"""Every framework page's Python snippets run as written (docs/frameworks/*.md).

A page's snippets are the lines a user adds to the framework's code: they run in order, in one
namespace holding what that code has where they go (the trainer, its batch, `self`, ...; set
again before each block, what earlier blocks defined staying). Those
objects come from the framework's own test module, `tests/adapters/test_<page>.py`, which builds
them with the framework's real classes: its `doc_snippet(request)` is a context manager giving
`(names, check)`, the names the snippets find in scope and a check of what running them must have
done. A new page plugs in by giving its test module a `doc_snippet`; a page without one fails here.

A page whose lines go *into* the framework's own functions (OpenRLHF, slime, prime-rl, NeMo RL)
is run there instead, by tests of its module that read the page and insert its blocks as
written: the module names them in `RUNS_PAGE_SNIPPETS`, and this test checks they are there.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "frameworks").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a page, in order, dedented (some show lines inside a method)."""
    return [textwrap.dedent(block) for block in _BLOCK.findall(text)]


def test_the_pages_are_found() -> None:
    """Every framework page is collected, and a page's blocks are read whole."""
    assert {p.stem for p in PAGES} >= {"areal", "open_instruct", "skyrl", "torchforge", "trl", "verl"}
    text = "intro\n```python\nx = 1\n\n    y = 2\n```\nmore\n```python\n    z = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n\n    y = 2\n", "z = 3\n"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_framework_page_snippets_run_as_written(page: Path, request: pytest.FixtureRequest) -> None:
    """The page's snippets, run in order with the framework objects its test module builds, do
    what the page says (the module's check)."""
    name = f"tests.adapters.test_{page.stem}"
    where = f"give {name.replace('.', '/')}.py a doc_snippet(request) (see {Path(__file__).name})"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        pytest.fail(f"{page.name}: nothing runs its snippets: {where}")
    provider = getattr(module, "doc_snippet", None)
    runners = getattr(module, "RUNS_PAGE_SNIPPETS", ())
    if provider is None and runners:
        # Run in the framework's own code by these tests, which must exist and read this page.
        assert all(callable(getattr(module, test, None)) for test in runners), runners
        assert page.name in Path(inspect.getfile(module)).read_text(), f"{name} never reads {page.name}"
        return
    if provider is None:
        pytest.fail(f"{page.name}: nothing runs its snippets: {where}")
    blocks = python_blocks(page.read_text())
    assert blocks, f"{page.name} has no ```python snippet"
    with provider(request) as (names, check):
        namespace: dict[str, object] = {"__name__": f"snippet_{page.stem}"}
        for i, block in enumerate(blocks):
            # Each block finds the framework code's names as they are where it goes; what earlier
            # blocks defined (an import) stays.
            namespace.update(names)
            # Top-level `await` is allowed: some hooks go in the framework's coroutines.
            code = compile(
                block, f"{page.name} snippet {i + 1}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            )
            result = eval(code, namespace)
            if inspect.iscoroutine(result):
                asyncio.run(result)
        check(namespace)
