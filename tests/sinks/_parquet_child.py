"""Programs the Parquet sink tests run as subprocesses (``python -m tests.sinks._parquet_child MODE ...``).

- ``trainer DIR SPOOL``: logs to a ParquetSink until it is killed. It spools each call before
  it returns (``durability="enqueue"``) and prints ``LOGGED <n>`` once `n` samples are
  accepted, so the parent knows what the archive must hold after a replay.
- ``killed-after-write DIR [N]``: writes N records (30 by default: ``k-0`` ... ``k-29``) to a sink
  that holds up to 1000 a file, then SIGKILLs itself: they are in its journal only.
- ``stream DIR NAME``: writes batches of 10 records (``NAME-0`` ...) straight to a sink that rolls
  a file every 20 records, printing ``WRITTEN <n>`` after each write returns, until it is killed.
- ``fork-then-killed DIR``: a session logs 30 samples to a sink (its writer in a process),
  forks a child that sleeps, and SIGKILLs itself. It prints ``WRITER <pid>``, ``HOLDER <pid>``
  and, from the child, ``HOLDS <n>``: how many descriptors on the journal the child has.
- ``disk-full DIR``: a write the file-size limit refuses (RLIMIT_FSIZE: EFBIG, as a full disk's
  ENOSPC), then the same write again without the limit; prints ``refused <errno>`` and whether
  the archive then holds the ten records exactly once.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import time
from pathlib import Path

import anyio
import psutil
import pyarrow.parquet as pq

import asynctrace as at
from asynctrace._records.types import TraceRecord
from tests._util import sample


async def trainer(directory: str, spool: str) -> None:
    sink = at.ParquetSink(directory, max_records=40)
    async with at.TraceSession(
        "p", run="killed", sinks=[sink], spool_dir=spool, durability="enqueue", batch_size=20
    ) as session:
        logged = 0
        step = 0
        while True:
            await session.log_samples([sample(logged + k, step=step) for k in range(20)], step=step)
            logged += 20
            step += 1
            print(f"LOGGED {logged}", flush=True)
            await anyio.sleep(0.01)


def _record(rid: str, pad: int = 0) -> TraceRecord:
    payload = b'{"messages":[],"metadata":{"pad":"' + b"y" * pad + b'"}}'
    return TraceRecord(rid, 0, "train", "k", payload, time.time())


async def _open(directory: str, max_records: int) -> at.ParquetSink:
    sink = at.ParquetSink(directory, max_records=max_records)
    sink.bind("p", "r")
    await sink.open()
    return sink


async def killed_after_write(directory: str, count: str = "30") -> None:
    sink = await _open(directory, 1000)
    await sink.write([_record(f"k-{i}") for i in range(int(count))])
    os.kill(os.getpid(), signal.SIGKILL)


async def stream(directory: str, name: str) -> None:
    sink = await _open(directory, 20)
    written = 0
    while True:
        await sink.write([_record(f"{name}-{written + i}", pad=500) for i in range(10)])
        written += 10
        print(f"WRITTEN {written}", flush=True)


def _say(line: str) -> None:
    """One line in one write: the trainer and its forked child share stdout."""
    os.write(1, f"{line}\n".encode())


async def fork_then_killed(directory: str) -> None:
    async with at.TraceSession("p", run="forked", sinks=[at.ParquetSink(directory)]) as session:
        await session.log_samples([sample(i) for i in range(30)], step=0)
        assert await session.flush(timeout=60)
        (writer,) = [p for p in psutil.Process().children() if "_parquet_worker" in " ".join(p.cmdline())]
        _say(f"WRITER {writer.pid}")
        (journal,) = [str(p) for p in Path(directory).glob(".*.journal")]
        pid = os.fork()
        if pid == 0:
            held = 0
            for name in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    held += os.readlink(f"/proc/self/fd/{name}") == journal
            _say(f"HOLDS {held}")
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            time.sleep(30)
            os._exit(0)
        _say(f"HOLDER {pid}")
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)


async def disk_full(directory: str) -> None:
    sink = await _open(directory, 10)
    records = [_record(f"x-{i}", pad=5000) for i in range(10)]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        await sink.write(records)
    except OSError as exc:
        print("refused", exc.errno)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    await sink.write(records)  # the retry
    await sink.close()
    ids = pq.read_table(directory).column("id").to_pylist()
    print(sorted(ids) == sorted(r.id for r in records))


if __name__ == "__main__":
    modes = {
        "trainer": trainer,
        "killed-after-write": killed_after_write,
        "disk-full": disk_full,
        "stream": stream,
        "fork-then-killed": fork_then_killed,
    }
    anyio.run(modes[sys.argv[1]], *sys.argv[2:])
