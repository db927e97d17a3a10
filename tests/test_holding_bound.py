"""The buffer's bound holds with a holding sampler (top_bottom, reservoir): a step's selection
is admitted only while the queue has room, so a producer faster than the sinks waits or drops."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import asynctrace as at
from tests._util import sample
from tests.test_log_rollouts import _batch

pytestmark = pytest.mark.anyio

QUEUE_SIZE = 100
MAX_BYTES = 100_000
K = 8
MAX_OPEN_STEPS = 2
STEPS = 80
PER_STEP = 16


def _padded(i: int, step: int, nbytes: int) -> dict[str, Any]:
    """`sample(i, step=step)` padded to about `nbytes` encoded bytes."""
    return sample(i, step=step, pad="x" * nbytes)


def _session(sampler: str, policy: str, sink: at.Sink, **kw: Any) -> at.TraceSession:
    options: dict[str, Any] = {
        "sampler": sampler,
        "max_traces_per_step": K,
        "queue_size": QUEUE_SIZE,
        "max_open_steps": MAX_OPEN_STEPS,
        "max_queue_bytes": MAX_BYTES,
        "on_full": policy,
        "finish_timeout": 30,
    }
    return at.TraceSession("p", sinks=[sink], **{**options, **kw})


def _check_bound(peak_depth: int, peak_bytes: int) -> None:
    # Only flush(), finish() and the idle timeout close steps past the bound (configuration.md):
    # while samples are being logged the queue stays within it.
    assert peak_depth <= QUEUE_SIZE, peak_depth
    assert peak_bytes <= MAX_BYTES, peak_bytes


@pytest.mark.parametrize("sampler", ["top_bottom", "reservoir"])
@pytest.mark.parametrize("policy", ["block", "drop_newest", "drop_oldest"])
@pytest.mark.parametrize("pad", [300, 3000])  # the record bound binds first, then the byte bound
async def test_a_holding_sampler_keeps_the_queue_within_its_bound(
    sampler: str, policy: str, pad: int
) -> None:
    """A producer far faster than the sink, with a holding sampler: the queue never holds more
    than the bound plus a selection per open step, and on_full acts (block waits and drops
    nothing, the drop policies drop and count as "queue_full")."""
    sink = at.testing.MemorySink(delay=0.01)
    peak_depth = peak_bytes = 0
    async with _session(sampler, policy, sink) as s:
        for step in range(STEPS):
            await s.log_samples([_padded(i, step, pad) for i in range(PER_STEP)], step=step)
            st = s.stats()
            peak_depth, peak_bytes = max(peak_depth, st.queue_depth), max(peak_bytes, st.queue_bytes)
    st = s.stats()
    assert st.check() and st.pending == 0, st.summary()
    _check_bound(peak_depth, peak_bytes)
    if policy == "block":
        assert st.written == STEPS * K and set(st.dropped) == {"capped"}, st.summary()
    else:
        assert set(st.dropped) == {"capped", "queue_full"}, st.summary()


@pytest.mark.parametrize("policy", ["block", "drop_newest"])
def test_the_blocking_form_and_nowait_keep_the_bound_with_a_holding_sampler(policy: str) -> None:
    """The same from threads: the blocking form waits for room (block) and log_samples_nowait
    drops (it never waits); either way the queue stays within the bound."""
    sink = at.testing.MemorySink(delay=0.01)
    peaks = [0, 0]
    with _session("top_bottom", policy, sink) as s:
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                st = s.stats()
                peaks[0], peaks[1] = max(peaks[0], st.queue_depth), max(peaks[1], st.queue_bytes)
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for step in range(STEPS):
                batch = [_padded(i, step, 300) for i in range(PER_STEP)]
                if policy == "block":
                    s.log_samples(batch, step=step)
                else:
                    s.log_samples_nowait(batch, step=step)
        finally:
            stop.set()
            watcher.join()
        st = s.finish()
    assert st.check() and st.pending == 0, st.summary()
    _check_bound(peaks[0], peaks[1])
    if policy == "block":
        assert st.written == STEPS * K and set(st.dropped) == {"capped"}, st.summary()
    else:
        assert st.dropped["queue_full"] > 0, st.summary()


async def test_log_rollouts_keeps_the_bound_with_a_holding_sampler() -> None:
    """log_rollouts reserves places in a holding sampler's selection only while the queue has
    room: under block it waits, and the queue stays within the bound."""
    tok, ids, (loss, attn), _ = _batch(PER_STEP)
    sink = at.testing.MemorySink(delay=0.02)
    peak = 0
    async with _session("top_bottom", "block", sink, queue_size=2 * K) as s:
        for step in range(40):
            rewards = [float(i) for i in range(PER_STEP)]
            await s.log_rollouts(
                ids, tokenizer=tok, step=step, rewards=rewards, loss_mask=loss, attention_mask=attn
            )
            peak = max(peak, s.stats().queue_depth)
    st = s.stats()
    assert st.check() and st.written == 40 * K and set(st.dropped) == {"capped"}, st.summary()
    assert peak <= 2 * K, peak
