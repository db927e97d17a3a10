"""The ledger's derived counts: `accepted` is what the calls returned, whatever became of it."""

from __future__ import annotations

import anyio
import pytest

import asynctrace as at
from tests._util import sample

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("policy", ["drop_newest", "drop_oldest"])
async def test_accepted_is_what_the_calls_returned_behind_a_stuck_sink(policy: str) -> None:
    """Dropped at the door (drop_newest, invalid) is not accepted; evicted later (drop_oldest) is."""
    stuck = at.testing.MemorySink("stuck", hang=True)
    async with at.TraceSession(
        "p",
        sinks=[stuck],
        queue_size=8,
        batch_size=4,
        on_full=policy,  # type: ignore[arg-type]
        on_invalid="skip",
        finish_timeout=0.5,
    ) as s:
        with anyio.fail_after(5):
            returned = sum([await s.log_samples([sample(i), {"bad": object()}], step=0) for i in range(40)])
        st = s.stats()
        assert st.accepted == returned == (8 if policy == "drop_newest" else 40)
        assert st.dropped == {"queue_full": 32, "invalid": 40} and st.check()
    assert s.stats().accepted == returned
    assert s.log_samples_nowait([sample(99)], step=0) == 0
    st = s.stats()
    assert st.accepted == returned and st.dropped["closed"] == 1 and st.check()


async def test_accepted_counts_held_samples_a_holding_sampler_displaced() -> None:
    """A held sample a better one displaces later stays accepted; one the cap refuses never was."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], max_traces_per_step=2, sampler="top_bottom") as s:
        rising = sum([await s.log_samples([sample(i, reward=float(i))], step=0) for i in range(1, 7)])
        between = await s.log_samples([sample(7, reward=3.5)], step=0)
    st = s.stats()
    assert (rising, between) == (6, 0)
    assert st.written == 2 and st.dropped == {"capped": 5} and st.check()
    assert st.accepted == 6 == st.written + 4  # four rising samples were displaced after they were accepted
