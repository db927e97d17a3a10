"""A trainer logging to offline W&B through `WandbSink`, run as a subprocess so that a test can
stop or kill its own `wandb-core` (``python -m tests.sinks._wandb_child ROOT RUN INTERVAL [SPOOL]``,
INTERVAL being the sink's ``log_flush_interval``).

It prints one JSON line per stage and waits for a line on stdin before the next one (the test
stops, kills or resumes the service in between):

1. the run is open: its `.wandb` file, and what was replayed from the spool;
2. it logs ``SAMPLES`` samples (5 by default) and flushes for at most ``FLUSH`` seconds (2):
   whether the flush confirmed them, the sink's counts and the samples' ids;
3. it flushes for at most 30 s, finishes the session and prints the final counts.

With ``ATTACH=1`` the sink is attached to a trainer's run the child opens (its `.wandb` file
written every INTERVAL seconds), and in stage 2 the trainer logs its next W&B step after the
samples, so that W&B writes their rows.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio
import orjson

import asynctrace as at
from tests._util import sample

SETTINGS = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}


def emit(data: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(data).decode() + "\n")
    sys.stdout.flush()


def counts(session: at.TraceSession) -> dict[str, Any]:
    st = session.stats()
    wandb = st.sinks["wandb"]
    return {
        "written": wandb.written,
        "failed": wandb.failed,
        "error": wandb.last_error,
        "replayed": st.replayed,
        "dead_letters": st.spool.dead_letters if st.spool is not None else None,
        "check": st.check(),
    }


async def main(root: str, run: str, interval: float, spool: str | None) -> None:
    trainer: Any = None
    if os.environ.get("ATTACH") == "1":
        import wandb

        settings = wandb.Settings(**SETTINGS, x_transaction_log_flush_interval=interval)  # type: ignore[arg-type]
        trainer = wandb.init(project="p", name=f"{run}-trainer", dir=root, settings=settings)
        sink = at.WandbSink(attach=trainer)
    else:
        init = {"dir": root, "settings": dict(SETTINGS)}
        sink = at.WandbSink(init_kwargs=init, log_flush_interval=interval)
    memory = at.testing.MemorySink("memory")
    kwargs: dict[str, Any] = {"spool_dir": spool} if spool else {}
    retry = at.RetryPolicy(max_attempts=2, initial_backoff=0.05, attempt_timeout=30.0)
    async with at.TraceSession("p", run=run, sinks=[sink, memory], retry=retry, **kwargs) as s:
        with anyio.fail_after(60):
            while sink.wandb_run is None:
                await anyio.sleep(0.01)
        emit({"log": sink.wandb_run.settings.sync_file, **counts(s)})
        await anyio.to_thread.run_sync(sys.stdin.readline)
        n = int(os.environ.get("SAMPLES", "5"))
        if n:
            await s.log_samples([sample(i) for i in range(n)], step=0)
        if trainer is not None:
            # Handed to the trainer's open step, where they wait for it: a flush does not.
            assert await s.flush(timeout=30.0) and s.stats().sinks["wandb"].written == 0
            trainer.log({"trainer/loss": 0.0}, step=1)
        flushed = await s.flush(timeout=float(os.environ.get("FLUSH", "2")))
        emit({"flushed": flushed, **counts(s), "ids": [r.id for r in memory.records]})
        await anyio.to_thread.run_sync(sys.stdin.readline)
        flushed = await s.flush(timeout=30.0)
    emit({"flushed": flushed, **counts(s), "finished": sink.finished})


if __name__ == "__main__":
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_API_KEY="", WANDB_DIR=sys.argv[1])
    anyio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
