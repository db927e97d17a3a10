"""An archive's first open: the overview from the typed columns and the metadata first, the
token-level values (most of the reading) after it, with the same index in the end."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import asynctrace as at
from asynctrace.view._archive import Archive

from . import _archive


def _index(archive: Archive) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = archive._con.execute("SELECT * FROM idx ORDER BY src, rn").fetchall()
    return rows


def test_token_values_read_later_give_the_same_index(tmp_path: Path) -> None:
    """Indexed without the token columns and then completed, an archive has the index it has
    when read at once: which records have token fields, and lengths from the loss mask."""
    parquet = _archive.without_sidecars(_archive.write(tmp_path)[0], tmp_path / "bare")
    at_once = Archive(parquet)
    at_once.build()
    later = Archive(parquet)
    later.build(defer_tokens=True)
    assert not later.tokens_ready.is_set()
    assert any(r[10] for r in _index(at_once)) and all(r[10] is None for r in _index(later))
    later.complete_tokens()
    assert later.tokens_ready.is_set() and _index(later) == _index(at_once)


def test_the_overview_waits_for_lengths_only_tokens_give(tmp_path: Path) -> None:
    """Records without a length in their metadata take it from their loss mask: the overview
    then waits for the token columns, and shows the lengths a full read gives."""
    parquet, _ = _archive.write(tmp_path)
    loaded = Archive(parquet)
    loaded.load(keep=False)
    assert loaded.tokens_ready.is_set()
    full = Archive(parquet)
    full.load()
    assert loaded.overview() == full.overview()


def _write_with_lengths(directory: Path) -> None:
    """Records whose metadata give their length, one in four with token fields."""

    async def main() -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        async with at.TraceSession(
            "first-open", run="r", sinks=[at.ParquetSink(directory, process=False)], health_metrics=False
        ) as session:
            for step in range(3):
                batch = [
                    at.Sample(
                        messages=[
                            {"role": "user", "content": "q"},
                            {"role": "assistant", "content": f"a{i}"},
                        ],
                        metadata={"reward": i / 8, "group_uid": f"g{step}", "response_len": 3},
                        tokens={"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} if i % 4 == 0 else None,
                    )
                    for i in range(8)
                ]
                await session.log_samples(batch, step=step)

    anyio.run(main)


def test_pages_with_token_values_wait_for_them(tmp_path: Path) -> None:
    """With every length in the metadata the overview answers before the token columns are read;
    a page that shows token values waits for them, then shows them."""
    _write_with_lengths(tmp_path / "archive")
    archive = Archive(_archive.without_sidecars(tmp_path / "archive", tmp_path / "bare"))
    archive.load(keep=False)
    assert not archive.tokens_ready.is_set()
    assert [r.samples for r in archive.overview()] == [8, 8, 8]
    record = archive._con.execute("SELECT id FROM idx WHERE rn = 0 AND step = 0").fetchone()
    assert record is not None
    answers: list[Any] = []
    waiting = threading.Thread(target=lambda: answers.append(archive.tokens(record[0])))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and answers == []  # it waits for the token values
    archive.complete_tokens()
    waiting.join(10)
    assert answers and answers[0] is not None and list(answers[0]["token_ids"]) == [1, 2, 3]
    assert sum(c.has_tokens for c in archive.find(low=0.0, high=1.0)) == 6


def test_a_later_start_answers_the_overview_from_the_kept_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start over the same files answers the overview from what the former one kept, the same
    page, before its index is read; other pages say "indexing" until it is. A changed archive
    has no summary."""
    from asynctrace.view import _app
    from asynctrace.view._archive import Archive as Store

    from ._html import get

    parquet, _ = _archive.write(tmp_path / "run")
    cache = tmp_path / "cache"
    first = Store(parquet, cache=cache)
    first.load()  # keeps the index and the summary
    with _archive.serving(_app.build_app(first, watch=("p-alpha",))) as base:
        indexed = get(base, "/").html
    release = threading.Event()
    real_load = Store.load

    def slow_load(self: Any, keep: bool = True) -> None:
        assert release.wait(20)
        real_load(self, keep)

    monkeypatch.setattr(Store, "load", slow_load)
    later = Store(parquet, cache=cache)
    loading = _app.Loading(later)
    try:
        with _archive.serving(_app.build_app(later, watch=("p-alpha",), loading=loading)) as base:
            early = get(base, "/")
            assert early.status == 200 and early.html == indexed
            assert get(base, "/step?step=1").status == 503
            release.set()
            assert loading.done.wait(20)
            assert get(base, "/step?step=1").status == 200 and get(base, "/").html == indexed
    finally:
        release.set()
    assert later.read_summary() is not None
    _write_with_lengths(parquet)  # one more file: the kept summary is not of these files
    assert Store(parquet, cache=cache).read_summary() is None
