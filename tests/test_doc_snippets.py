"""Every framework page's and every sink page's Python snippets run as written.

A framework page's snippets (docs/frameworks/*.md) are the lines a user adds to the framework's
code: they run in order, in one namespace holding what that code has where they go (the trainer,
its batch, `self`, ...; set again before each block, what earlier blocks defined staying). Those
objects come from the framework's own test module, `tests/adapters/test_<page>.py`, which builds
them with the framework's real classes: its `doc_snippet(request)` is a context manager giving
`(names, check)`, the names the snippets find in scope and a check of what running them must have
done. A new page plugs in by giving its test module a `doc_snippet`; a page without one fails here.

A page whose lines go *into* the framework's own functions (OpenRLHF, slime, prime-rl, NeMo RL)
is run there instead, by tests of its module that read the page and insert its blocks as
written: the module names them in `RUNS_PAGE_SNIPPETS`, and this test checks they are there.

The sink pages (docs/sinks.md, docs/sinks/*.md) run in a temporary directory with `at` in scope,
each block after what `SINK_PAGES` gives that page: data for a block that reads it back, a check
of what a block did. A block that needs a live backend run is compiled only, its reason named.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import re
import textwrap
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest

import asynctrace

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


def _run_block(page: Path, i: int, block: str, namespace: dict[str, Any]) -> None:
    code = compile(block, f"{page.name} snippet {i + 1}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if inspect.iscoroutine(result):
        asyncio.run(result)


@dataclass(frozen=True)
class SinkPage:
    """What one sink page's blocks need: `before[i]` runs before block i (it may fill the data
    the block reads), `after[i]` checks what block i did; `not_run[i]` says why block i is only
    compiled."""

    before: Mapping[int, Callable[[dict[str, Any]], None]] = field(default_factory=dict)
    after: Mapping[int, Callable[[dict[str, Any]], None]] = field(default_factory=dict)
    not_run: Mapping[int, str] = field(default_factory=dict)


def _samples(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}", "response": f"answer {i}", "reward": i / n} for i in range(n)]


def _log_through(session: Any, steps: Sequence[int], n: int = 20) -> Any:
    async def run() -> Any:
        async with session as s:
            for step in steps:
                await s.log_samples(_samples(n), step=step)
        return s.stats()

    return asyncio.run(run())


def _tiered_session_logged(ns: dict[str, Any]) -> None:
    """The tiered session as the page builds it: 20 samples of step 3, every one in the JSONL
    archive, Trackio's top and bottom 16; the lookup then finds a real id."""
    stats = _log_through(ns["session"], [3])
    assert stats.check() and stats.written == 20
    assert stats.sinks["trackio"].written == 16 and stats.sinks["trackio"].skipped == {"capped": 4}
    # Trace lines, and the session's health metrics as lines of their own.
    lines = [orjson.loads(line) for line in Path("traces/run.jsonl").read_bytes().splitlines()]
    records = [line for line in lines if "id" in line]
    assert len(records) == 20
    ns["_id"] = records[7]["id"]


def _lookup_found(ns: dict[str, Any]) -> None:
    assert ns["row"]["id"] == ns["_id"] and ns["row"]["step"] == 3
    assert ns["row"]["sample"]["messages"][0]["content"] == "question 7"


def _http_sink_posts_and_gives_up_on_a_4xx(ns: dict[str, Any]) -> None:
    """The page's HttpSink against a local collector: each batch arrives as JSON lines; a 400
    fails the batch at once (not retried), a 503 is retried."""
    received: list[bytes] = []
    answers: list[int] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(answers.pop(0) if answers else 200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/traces"
    retry = asynctrace.RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)
    try:
        answers[:] = [503]
        sink = ns["HttpSink"](url)
        stats = _log_through(asynctrace.TraceSession("doc", sinks=[sink], retry=retry), [0], n=5)
        assert stats.written == 5 and stats.sinks["http"].retries == 1
        assert [orjson.loads(line)["id"] for line in received[-1].split(b"\n")] and len(received) == 2
        answers[:] = [400]
        sink = ns["HttpSink"](url)
        stats = _log_through(asynctrace.TraceSession("doc", sinks=[sink], retry=retry), [0], n=5)
        assert stats.failed == 5 and stats.sinks["http"].retries == 0 and len(received) == 3
    finally:
        server.shutdown()
        server.server_close()


def _archive_written(ns: dict[str, Any]) -> None:
    import duckdb
    import pandas

    sink = asynctrace.ParquetSink("archive/", process=False)
    stats = _log_through(asynctrace.TraceSession("doc", sinks=[sink]), [0, 1])
    assert stats.written == 40
    ns.update(duckdb=duckdb, pandas=pandas)


def _jsonl_line_as_shown(ns: dict[str, Any]) -> None:
    """A line the sink writes has the fields, and the sample the keys, of the page's example."""
    page = (ROOT / "docs" / "sinks" / "jsonl.md").read_text(encoding="utf-8")
    shown = orjson.loads(re.search(r"```json\n(.*?)```", page, re.DOTALL).group(1))  # type: ignore[union-attr]
    sink = asynctrace.JsonlSink("traces/run.jsonl")
    assert _log_through(asynctrace.TraceSession("doc", sinks=[sink]), [3], n=1).written == 1
    line = orjson.loads(Path("traces/run.jsonl").read_bytes().splitlines()[0])
    assert line.keys() == shown.keys() and line["sample"].keys() == shown["sample"].keys()


def _trainer_in_scope(ns: dict[str, Any]) -> None:
    async def run_my_trainer(session: Any, steps: int) -> None:
        for step in range(steps):
            await session.log_samples(_samples(12), step=step)

    ns["run_my_trainer"] = run_my_trainer


SINK_PAGES: dict[str, SinkPage] = {
    "sinks": SinkPage(
        after={0: _tiered_session_logged, 1: _lookup_found, 2: _http_sink_posts_and_gives_up_on_a_4xx},
    ),
    "trackio": SinkPage(),
    "parquet": SinkPage(
        before={1: _archive_written},
        after={1: lambda ns: len(ns["df"]) == 40 or pytest.fail(f"{len(ns['df'])} rows read back")},
    ),
    "wandb": SinkPage(
        # `attach=run` names the trainer's run object; the next line replaces that sink unopened.
        before={0: lambda ns: ns.update(run=object())},
        after={0: lambda ns: ns["s"].stats().check() or pytest.fail("accounting")},
        not_run={1: "it reads the table files of an offline W&B run (seconds to start one)"},
    ),
    "jsonl": SinkPage(after={0: _jsonl_line_as_shown}),
    "mlflow": SinkPage(
        not_run={
            1: "it searches a tracking store holding the sink's run (a new SQLite store migrates for "
            "5-9 s); tests/sinks/test_mlflow.py searches one with the same filters"
        },
    ),
    "console": SinkPage(),
    "memory": SinkPage(
        before={0: _trainer_in_scope},
        after={0: lambda ns: asyncio.run(ns["test_my_trainer_logs_8_traces_per_step"]())},
    ),
}
SINK_DOCS = [ROOT / "docs" / "sinks.md", *sorted((ROOT / "docs" / "sinks").glob("*.md"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", SINK_DOCS, ids=[p.stem for p in SINK_DOCS])
def test_sink_page_snippets_run_as_written(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each sink page's blocks run in order in one namespace, in a temporary directory, and do
    what the page says; a block that reads data back reads real data its sink wrote."""
    spec = SINK_PAGES.get(page.stem)
    assert spec is not None, f"{page.name}: give it an entry in SINK_PAGES ({Path(__file__).name})"
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    assert blocks, f"{page.name} has no ```python snippet"
    named = {*spec.before, *spec.after, *spec.not_run}
    assert named <= set(range(len(blocks))), f"{page.name}: SINK_PAGES names blocks it does not have"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": f"snippet_{page.stem}", "at": asynctrace}
    for i, block in enumerate(blocks):
        if i in spec.not_run:
            compile(block, f"{page.name} snippet {i + 1}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            continue
        if i in spec.before:
            spec.before[i](namespace)
        if "_id" in namespace:  # the page's example id stands for one the tracker shows
            block = block.replace(EXAMPLE_ID, namespace["_id"])
        _run_block(page, i, block, namespace)
        if i in spec.after:
            spec.after[i](namespace)
    capsys.readouterr()


# The record id the pages use as an example of one a tracker shows.
EXAMPLE_ID = "3f9c0a1b2d4e-17"
