"""Run a framework page's hook lines as written: read from the page, put in the framework's own function."""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs" / "frameworks"


def code_block(page: str, language: str = "python", index: int = 0) -> str:
    """The `index`-th fenced block of `language` on docs/frameworks/`page`."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)
    return str(blocks[index])


@dataclass
class Insertion:
    """Lines to add to `function` (``Class.function``) right after the statement `anchor`."""

    function: str
    anchor: str
    lines: str


def hook_lines(block: str) -> tuple[str, list[Insertion]]:
    """A hook block's import paragraph and its insertions.

    Each paragraph after the first starts with ``# Class.function, after: <statement>``; the
    lines under it are what goes right after that statement.
    """
    paragraphs = [p for p in block.strip().split("\n\n") if p.strip()]
    insertions = []
    for paragraph in paragraphs[1:]:
        head, _, body = paragraph.partition("\n")
        match = re.fullmatch(r"# (\S+), after: (.+)", head.strip())
        assert match, f"not a '# Class.function, after: <statement>' line: {head!r}"
        insertions.append(Insertion(match[1], match[2].strip(), body))
    return paragraphs[0], insertions


def patched(function: Callable[..., Any], insertion: Insertion, imports: str) -> Callable[..., Any]:
    """`function` recompiled from its source with `insertion.lines` after `insertion.anchor`.

    It runs in a copy of the function's module namespace, after `imports` ran there, as the
    edited file would.
    """
    source = textwrap.dedent(inspect.getsource(function))
    out, found = [], 0
    for line in source.splitlines():
        out.append(line)
        if line.strip() == insertion.anchor:
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + added for added in insertion.lines.splitlines())
            found += 1
    assert found == 1, f"{insertion.anchor!r} occurs {found} times in {insertion.function}"
    namespace = dict(vars(inspect.getmodule(function)))
    exec(compile(imports, "<docs snippet>", "exec"), namespace)
    exec(compile("\n".join(out), inspect.getsourcefile(function) or "<source>", "exec"), namespace)
    result: Callable[..., Any] = namespace[function.__name__]
    return result
