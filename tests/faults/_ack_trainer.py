"""A trainer for tests/faults/test_recover_acks.py, run as a subprocess.

``kill``: an archive that stops for good after 26 records (a sink far behind) and a `Selected`
tier of 4 a step, a watched prompt (index 13), 16 samples a step (reward = index) for steps
0..9 in batches of 26, so that steps straddle batches. Once the tier has written what it can,
the process SIGKILLs itself: the tier has closed steps 0..6 (top_bottom) that the archive holds
only part of, holds steps 7..9 (or, "first", has written 4 of step 9 having seen 12 of it), and
the tail of step 9 (its watched sample included) and two late samples of step 3 were never
dispatched.

``kill-flushed``: the same, with a `flush()` after step 9 (the tier closes and writes every step;
the archive never answers) before the stragglers are logged.

``restart``: the same sinks, none stalled, on the same spool: it replays what the killed one left.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio

import asynctrace as at
from tests.faults._ack_sinks import UidFileSink, uids

PER_STEP, STEPS, TIER, WATCHED, BATCH = 16, 10, 4, 13, 26


def _row(step: int, i: int) -> dict[str, object]:
    return {"prompt": f"q{i}", "response": "a", "reward": float(i), "prompt_id": i, "uid": f"{step}:{i}"}


def main() -> int:
    mode, spool, archive, tier, sampler = sys.argv[1:6]
    stall = 26 if mode.startswith("kill") else None
    sinks: list[at.Sink] = [
        UidFileSink(archive, name="archive", stall_after=stall),
        at.sinks.Selected(UidFileSink(tier, name="tier"), max_traces_per_step=TIER, sampler=sampler),  # type: ignore[arg-type]
    ]

    async def run() -> None:
        session = at.TraceSession(
            "p",
            run="r",
            sinks=sinks,
            spool_dir=spool,
            durability="enqueue",
            watch=at.Watch(ids=[WATCHED]),
            batch_size=BATCH,
            flush_interval=30.0,
            retry=at.RetryPolicy(max_attempts=1, attempt_timeout=600.0),
            health_metrics=False,
        )
        async with session:
            if mode == "restart":
                assert await session.flush(timeout=60)
                return
            for step in range(STEPS):
                rows = [_row(step, i) for i in range(PER_STEP)]
                if step < STEPS - 1:
                    await session.log_samples(rows, step=step)
                    continue
                # The last step in two calls: the first fills a batch (the 14 left of step 8 and
                # 12 of these), dispatched at once; the other 4 wait for a batch that never comes.
                await session.log_samples(rows[:12], step=step)
                await session.log_samples(rows[12:], step=step)
            flushed = mode == "kill-flushed"
            if flushed:
                # The archive never answers, but the tier closes every step and writes it all.
                assert not await session.flush(timeout=1.0)
            # Two stragglers of step 3, never dispatched either, ranked above and below every
            # other: late for a top_bottom tier (step 3 closed), past a first tier's 4.
            late = [_row(3, 16), _row(3, 17)]
            late[0]["reward"], late[1]["reward"] = 100.0, -100.0
            await session.log_samples(late, step=3)
            # What the tier can write before the kill: top_bottom, steps 0..6 closed (4 each);
            # first, 4 of each of steps 0..9; and the watched sample of steps 0..8.
            want = (7 * TIER if sampler == "top_bottom" else STEPS * TIER) + STEPS - 1
            if flushed:
                want = (TIER + 1) * STEPS
            deadline = time.monotonic() + 60
            while len(uids(Path(tier))) < want:
                if time.monotonic() > deadline:
                    print(f"the tier holds {len(uids(Path(tier)))} of {want}", file=sys.stderr)
                    os._exit(3)
                await anyio.sleep(0.02)
            await anyio.sleep(0.5)  # the resolution after the write, committed to the spool
            os.kill(os.getpid(), signal.SIGKILL)

    anyio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
