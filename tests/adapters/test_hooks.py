"""The hooks' shared guarantee: a batch is logged or counted, and never raises into training."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

import asynctrace as at
import asynctrace.adapters
from asynctrace.adapters._hooks import Converted, count_rows, deliver
from asynctrace.adapters._requires import Framework, Need, gaps, report

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _good(n: int) -> Converted:
    return [at.Sample(messages=[{"role": "user", "content": f"q{i}"}]) for i in range(n)], 0


def test_record_invalid_keeps_the_invariant() -> None:
    """record_invalid counts rows as submitted and dropped ("invalid"), also after finish."""
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        session.record_invalid(3)
        assert session.stats().dropped["invalid"] == 3
    session.record_invalid(2)
    stats = session.stats()
    assert stats.submitted == 5 and stats.dropped["invalid"] == 5 and stats.check()
    with pytest.raises(ValueError, match="n"):
        session.record_invalid(-1)


def test_a_conversion_error_is_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    """A batch whose conversion raises is counted as invalid rows, with one warning per hook."""

    def broken() -> Converted:
        raise KeyError("responses")

    caplog.set_level(logging.WARNING, logger="asynctrace")
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as session:
        for _ in range(3):
            assert deliver(session, broken, rows=4, step=0, where="test.broken-hook") == 0
        assert deliver(session, lambda: _good(2), rows=2, step=1, where="test.broken-hook") == 2
    stats = session.stats()
    assert stats.dropped["invalid"] == 12 and stats.written == 2 and stats.check()
    warned = [r for r in caplog.records if "test.broken-hook" in r.getMessage()]
    assert len(warned) == 1 and "KeyError" in warned[0].getMessage()


def test_skipped_rows_and_refused_samples_are_counted() -> None:
    """Rows a conversion left out, and samples the session refuses, are counted, not raised."""

    def partly() -> Converted:
        samples: Sequence[at.Sample] = _good(3)[0]
        return samples, 2

    bad: Converted = ([at.Sample(messages=[{"role": "user", "content": 1}])], 0)  # type: ignore[dict-item]
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        assert deliver(session, partly, rows=5, step=0, where="test.partly") == 3
        assert deliver(session, lambda: bad, rows=1, step=0, where="test.refused") == 0
    stats = session.stats()
    assert stats.written == 3 and stats.dropped["invalid"] == 3 and stats.check()


@pytest.mark.anyio
async def test_async_session_from_the_trainer_thread() -> None:
    """An async session is handed the samples without waiting; after finish they count as closed."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink]) as session:
        assert deliver(session, lambda: _good(2), rows=2, step=0, where="test.async") == 2
    assert deliver(session, lambda: _good(1), rows=1, step=1, where="test.async") == 0
    stats = session.stats()
    assert stats.written == 2 and stats.dropped["closed"] == 1 and stats.check()


def test_rows_a_conversion_returned_nothing_for_are_counted() -> None:
    """Rows a conversion neither turned into samples nor reported skipped are counted as invalid;
    a batch whose rows could not be counted counts as one row when it fails."""

    def quietly_short() -> Converted:
        return _good(2)

    def broken() -> Converted:
        raise KeyError("response_ids")

    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as session:
        assert deliver(session, quietly_short, rows=5, step=0, where="test.short") == 2
        assert deliver(session, quietly_short, rows=5, step=0, where="test.merged", one_per_row=False) == 2
        assert deliver(session, broken, rows=None, step=0, where="test.uncounted") == 0
    stats = session.stats()
    assert stats.written == 4 and stats.dropped["invalid"] == 3 + 1 and stats.check()


def test_count_rows_takes_the_first_column_it_can_size() -> None:
    """A missing or unsized column is passed over for the next; a count given as an int is used."""
    import torch

    missing: dict[str, list[int]] = {}
    assert count_rows(lambda: missing["responses"], lambda: None, lambda: [1, 2, 3]) == 3
    assert count_rows(lambda: torch.zeros(4, 2), lambda: [1]) == 4
    assert count_rows(lambda: 7) == 7
    assert count_rows(lambda: "text", lambda: missing["x"]) is None


def test_the_api_page_names_every_adapter_and_its_hook() -> None:
    """docs/api.md's `asynctrace.adapters` section names every adapter module and a hook of it."""
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    section = text.split("## `asynctrace.adapters`", 1)[1].split("\n## ", 1)[0]
    modules = asynctrace.adapters.__all__
    assert [name for name in modules if f"`{name}`" not in section] == []
    assert [name for name in modules if f"`{name}." not in section] == []


def test_gaps_name_what_is_missing_or_shaped_otherwise() -> None:
    """Each need not met is named by its path: missing, not taking the arguments the hook passes,
    not a coroutine function, without a key, or unreadable; what is as expected is not named."""

    class Broken:
        @property
        def flaky(self) -> int:
            raise RuntimeError("no")

    class Trainer:
        def __init__(self) -> None:
            self.logs: dict[str, list[str]] = {"prompt": [], "completion": []}
            self.broken = Broken()

        def step(self, batch: object) -> None: ...

        def two(self, a: object, b: object) -> None: ...

        async def generate(self, batch: object) -> None: ...

    needs = [
        Need("step", args=1),
        Need("two", args=1),
        Need("generate", args=1, coroutine=True),
        Need("step", coroutine=True),
        Need("logs", keys=("prompt", "rewards")),
        Need("actor.compute"),
        Need("broken.flaky"),
        Need("", keys=("x",)),
    ]
    assert gaps(Trainer(), needs, "Trainer") == [
        "Trainer.two does not take 1 positional argument",
        "Trainer.step is not a coroutine function",
        "Trainer.logs has no 'rewards'",
        "Trainer.actor.compute is missing",
        "Trainer.broken.flaky cannot be read (RuntimeError: no)",
        "Trainer has no keys (a Trainer)",
    ]


def test_the_message_names_both_versions_once(hook_warnings: list[str]) -> None:
    """`report` names the version installed and the one tested, once per hook and problem."""
    framework = Framework("TRL", "0.0.1", "trl")
    assert (
        framework.versions() == f"TRL {importlib.metadata.version('trl')} is installed, tested with TRL 0.0.1"
    )
    assert Framework("slime", "commit 624b824a898a").versions() == "tested with slime commit 624b824a898a"
    for _ in range(2):
        report(framework, "test.report", ["X.y is missing"], "nothing is logged")
    (message,) = [m for m in hook_warnings if "test.report" in m]
    assert message.endswith(
        "(TRL 1.16.0 is installed, tested with TRL 0.0.1): X.y is missing; nothing is logged"
    )
