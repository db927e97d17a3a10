"""Bad arguments to waits, logging calls and sinks: a clear error naming them, and nothing left open."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import asynctrace as at
from tests._util import sample

# 10**400: no float holds it (float() raises OverflowError); a tensor of two has no one number.
BAD_TIMEOUTS = ["x", -1, float("nan"), True, 10**400, torch.ones(2)]


@pytest.mark.anyio
@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
async def test_a_bad_finish_timeout_is_refused_and_the_session_still_finishes(bad: Any) -> None:
    """finish(timeout=<bad>) raises ValueError naming timeout; leaving the block still finishes."""
    sink = at.testing.MemorySink()
    with anyio.fail_after(10):
        async with at.TraceSession("p", sinks=[sink]) as s:
            await s.log_samples([sample(0)], step=0)
            with pytest.raises(ValueError, match="timeout"):
                await s.finish(timeout=bad)
    assert sink.closed and len(sink.records) == 1


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_a_bad_finish_timeout_in_the_blocking_form_leaves_no_sink_open(bad: Any) -> None:
    """The blocking form's finish(timeout=<bad>) raises; leaving the block closes every sink."""
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as s:
        s.log_samples([sample(0)], step=0)
        with pytest.raises(ValueError, match="timeout"):
            s.finish(timeout=bad)
    assert sink.closed and len(sink.records) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
async def test_bad_timeouts_of_log_samples_and_flush_are_refused_up_front(bad: Any) -> None:
    """A bad timeout is refused even while there is room, before anything is counted."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(ValueError, match="timeout"):
            await s.log_samples([sample(0)], step=0, timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            await s.flush(timeout=bad)
        assert s.stats().submitted == 0
        assert await s.flush(timeout=0) in (True, False) and await s.flush(timeout=float("inf"))


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_bad_timeouts_in_the_blocking_form_are_refused(bad: Any) -> None:
    """The blocking form refuses a bad timeout for log_samples and flush too."""
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(ValueError, match="timeout"):
            s.log_samples([sample(0)], step=0, timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            s.flush(timeout=bad)
        assert s.stats().submitted == 0


@pytest.mark.anyio
@pytest.mark.parametrize("samples", [None, 5, 2.5])
async def test_samples_that_are_not_samples_name_the_argument(samples: Any) -> None:
    """log_samples(None) or a number is a RecordError about `samples`, not a bare TypeError."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(at.RecordError, match="samples: expected a Sample"):
            await s.log_samples(samples, step=0)
        with pytest.raises(at.RecordError, match="samples: expected a Sample"):
            s.log_samples_nowait(samples, step=0)


@pytest.mark.parametrize("key", ["prompt", "response"])
def test_messages_with_prompt_or_response_is_refused_not_dropped(key: str) -> None:
    """A mapping with both 'messages' and 'prompt'/'response' raises instead of dropping one."""
    from asynctrace._records.encode import encode_checked

    obj = {"messages": [{"role": "user", "content": "hi"}], key: "text"}
    with pytest.raises(at.RecordError, match=f"sample 0: {key}: given with 'messages'") as info:
        encode_checked(obj, 0, None, None)
    assert info.value.path == key


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: at.TrackioSink(process="no"), "process"),
        (lambda: at.TrackioSink(init_kwargs=3), "init_kwargs"),
        (lambda: at.TrackioSink(space_id=1), "space_id"),
        (lambda: at.TrackioSink(server_url=b"http://x"), "server_url"),
        (lambda: at.JsonlSink("x.jsonl", fsync="yes"), "fsync"),
    ],
)
def test_bad_sink_arguments_name_themselves(make: Any, name: str) -> None:
    """A sink argument of the wrong type is a ValueError naming it, at construction."""
    with pytest.raises(ValueError, match=name):
        make()


@pytest.mark.anyio
async def test_an_error_inside_the_callers_generator_reaches_the_caller_unchanged() -> None:
    """A TypeError raised by the caller's own generator is not reported as a bad `samples`."""

    def rows() -> Any:
        yield sample(0)
        raise TypeError("bug in my rollout loop")

    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(TypeError, match="bug in my rollout loop"):
            await s.log_samples(rows(), step=0)


def _number_likes() -> list[Any]:
    import numpy as np
    import torch

    return [0, 0.5, float("inf"), np.float32(0.5), np.int64(1), torch.tensor(0.5)]


@pytest.mark.parametrize("good", _number_likes(), ids=repr)
def test_number_like_timeouts_are_accepted_by_the_blocking_form(good: Any) -> None:
    """Zero, infinity, numpy scalars and a 0-d tensor are timeouts like a float."""
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink]) as s:
        assert s.log_samples([sample(0)], step=0, timeout=good) == 1
        s.flush(timeout=good)
        s.finish(timeout=good)
    assert sink.closed


@pytest.mark.anyio
@pytest.mark.parametrize("good", _number_likes(), ids=repr)
async def test_number_like_timeouts_are_accepted_by_the_async_form(good: Any) -> None:
    """The async form takes the same timeouts."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink]) as s:
        assert await s.log_samples([sample(0)], step=0, timeout=good) == 1
        await s.flush(timeout=good)
        await s.finish(timeout=good)
    assert sink.closed
