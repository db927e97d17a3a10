"""A small trainer for the fault-injection tests, run as a subprocess that the tests kill or signal.

It logs `--steps` steps of `--per-step` samples (uid ``"{step}:{i}"`` in the metadata) and,
after each `log_samples` call returns, appends the uids it acknowledged to `--acked`. It prints
``ready`` once the session is open. With `--stats` it writes the final stats as JSON.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import anyio
import orjson

import asynctrace as at


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--project", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--spool", default=None)
    p.add_argument("--durability", default="enqueue")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--per-step", type=int, default=32)
    p.add_argument("--interval", type=float, default=0.01)
    p.add_argument("--flush-interval", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--acked", required=True)
    p.add_argument("--stats", default=None)
    p.add_argument("--sink", choices=["trackio", "memory", "tiered"], default="trackio")
    p.add_argument("--parquet", default=None, help="with --sink tiered: the archive's directory")
    p.add_argument("--tier", type=int, default=4, help="with --sink tiered: Trackio's samples a step")
    p.add_argument("--hooks", action="store_true")
    p.add_argument("--sync", action="store_true", help="use the blocking `with TraceSession(...)` form")
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--prev-handler", default=None, help="install a SIGTERM handler first; it writes here")
    p.add_argument("--pad", type=int, default=600, help="characters of filler per response")
    p.add_argument("--fsize-limit", type=int, default=None, help="RLIMIT_FSIZE: a nearly full disk")
    return p.parse_args()


def _sample(step: int, i: int, pad: int) -> dict[str, Any]:
    return {
        "prompt": f"question {i} of step {step}",
        "response": f"answer {i} " + "x" * pad,
        "reward": float(i),
        "uid": f"{step}:{i}",
    }


def main() -> int:
    args = _args()
    if args.fsize_limit is not None:
        import resource

        # Writes past the limit fail with EFBIG (Python ignores SIGXFSZ), as on a full disk.
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    stop = False
    session: at.TraceSession | None = None

    if args.prev_handler:

        def previous(signum: int, frame: object) -> None:
            nonlocal stop
            # What a trainer's own handler typically does: note it, and stop at the next step.
            written = session.stats().written if session is not None else -1
            with open(args.prev_handler, "w") as f:
                f.write(orjson.dumps({"signal": signum, "written_when_called": written}).decode())
            stop = True

        signal.signal(signal.SIGTERM, previous)

    sink: at.Sink = at.TrackioSink() if args.sink == "trackio" else at.testing.MemorySink()
    sinks = [sink]
    if args.sink == "tiered":
        # The documented tiered setup: everything archived, a top/bottom selection in Trackio.
        tier = at.sinks.Selected(at.TrackioSink(), max_traces_per_step=args.tier, sampler="top_bottom")
        sinks = [at.sinks.ParquetSink(args.parquet), tier]

    def make_session() -> at.TraceSession:
        return at.TraceSession(
            args.project,
            run=args.run,
            sinks=sinks,
            spool_dir=args.spool,
            durability=args.durability,
            shutdown_hooks=args.hooks,
            batch_size=args.batch_size,
            flush_interval=args.flush_interval,
            queue_size=100_000,
            max_queue_bytes=1 << 30,
        )

    def run_sync() -> None:
        nonlocal session
        session = make_session()
        fd = os.open(args.acked, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with session as s:
            print("ready", flush=True)
            for step in range(args.steps):
                if stop:
                    break
                batch = [_sample(step, i, args.pad) for i in range(args.per_step)]
                s.log_samples(batch, step=step)
                os.write(fd, "".join(f"{b['uid']}\n" for b in batch).encode())
                time.sleep(args.interval)

    async def run() -> None:
        nonlocal session
        session = make_session()
        fd = os.open(args.acked, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            async with session:
                print("ready", flush=True)
                for step in range(args.steps):
                    if stop:
                        break
                    batch = [_sample(step, i, args.pad) for i in range(args.per_step)]
                    await session.log_samples(batch, step=step)
                    os.write(fd, "".join(f"{b['uid']}\n" for b in batch).encode())
                    await anyio.sleep(args.interval)
        finally:
            os.close(fd)

    started = time.monotonic()
    if args.sync:
        run_sync()
    else:
        anyio.run(run, backend=args.backend)
    if args.stats:
        assert session is not None
        st = session.stats()
        out = {
            "submitted": st.submitted,
            "written": st.written,
            "failed": st.failed,
            "pending": st.pending,
            "dropped": dict(st.dropped),
            "replayed": st.replayed,
            "unspooled": st.spool.unspooled if st.spool else None,
            "spool_error": st.spool.last_error if st.spool else None,
            "check": st.check(),
            "finished": getattr(sink, "finished", None),
            "memory_records": len(sink.records) if isinstance(sink, at.testing.MemorySink) else None,
            "seconds": time.monotonic() - started,
        }
        if args.stats == "-":
            print(orjson.dumps(out).decode(), flush=True)
        else:
            with open(args.stats, "wb") as f:
                f.write(orjson.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
