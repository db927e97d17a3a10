"""Programs the Trackio sink tests run as subprocesses (``python -m tests.sinks._children MODE ...``).

- ``config-after-disk-full PROJECT [public]``: a `TrackioWriter` with a run config whose first
  write fails for lack of space (RLIMIT_FSIZE, so SQLite gets EFBIG) and is retried; prints the
  stored configs as JSON. With ``public``, Trackio's bulk commit is changed first so that the
  writer goes through Trackio's public API.
- ``die-holding-pipe PROJECT BACKEND fork|exec``: a trainer that logs through the writer
  process, leaves a child holding whatever it inherited (a plain ``os.fork``, or a program
  started with the writer's stdin pipe in ``pass_fds``), then SIGKILLs itself. It prints
  ``WRITER <pid>``, ``HOLDER <pid>`` and, from a forked child, ``HOLDS <n>``: how many
  descriptors on the writer's stdin pipe the child has.
"""

from __future__ import annotations

import os
import resource
import signal
import sqlite3
import subprocess
import sys
import time

import anyio
import orjson


def config_after_disk_full(project: str, path: str = "private") -> None:
    from trackio.sqlite_storage import SQLiteStorage

    from asynctrace.sinks._trackio_writer import TrackioWriter, WriteItem

    if path == "public":
        real = SQLiteStorage.bulk_log
        SQLiteStorage.bulk_log = staticmethod(lambda *args, **kwargs: real(*args, **kwargs))  # type: ignore[method-assign]
    writer = TrackioWriter(project, "r", init_kwargs={"config": {"lr": 1e-5}}, seal_writes=True)
    writer.open()
    assert writer.path == path, writer.path
    payload = orjson.dumps({"messages": [{"role": "user", "content": "q" * 200_000}]})
    items = [WriteItem(f"abc-{i}", 0, "train/traces", payload, False, 1.7e9) for i in range(3)]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        writer.write(items)
    except Exception as exc:
        print(f"first write failed: {exc!r}", file=sys.stderr)
    else:
        raise SystemExit("the first write should have failed for lack of space")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    writer.write(items)  # the retry
    writer.finish()
    with sqlite3.connect(SQLiteStorage.get_project_db_path(project)) as conn:
        configs = [orjson.loads(row[0]) for row in conn.execute("SELECT config FROM configs")]
        traces = conn.execute("SELECT count(*) FROM traces").fetchone()[0]
    sys.stdout.write(orjson.dumps({"configs": configs, "traces": traces}).decode() + "\n")


def _fds_on(link: str) -> list[int]:
    """This process's descriptors open on `link` (as /proc shows it, e.g. ``pipe:[123]``)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == link:
                out.append(int(name))
        except OSError:
            pass
    return out


def _say(line: str) -> None:
    """Print one line in a single write. The forked child and the trainer share this stdout pipe,
    and `print` writes the text and its newline separately (unbuffered, as the tests run it), so
    their lines could interleave ("HOLDS 0HOLDER 12"); one write of at most PIPE_BUF bytes to a
    pipe is atomic."""
    os.write(1, f"{line}\n".encode())


def die_holding_pipe(project: str, backend: str, how: str) -> None:
    import asynctrace as at

    async def main() -> None:
        sink = at.TrackioSink()
        async with at.TraceSession(project, run="r", sinks=[sink]) as session:
            await session.log_samples([{"prompt": f"q{i}", "response": "a"} for i in range(4)], step=0)
            assert await session.flush(timeout=60)
            assert sink._proc is not None
            writer = sink._proc.pid
            _say(f"WRITER {writer}")
            pipe = os.readlink(f"/proc/{writer}/fd/0")
            if how == "fork":
                pid = os.fork()
                if pid == 0:
                    _say(f"HOLDS {len(_fds_on(pipe))}")
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, 1)
                    time.sleep(30)
                    os._exit(0)
            else:
                holder = subprocess.Popen(
                    [sys.executable, "-c", "import time; time.sleep(30)"],
                    pass_fds=_fds_on(pipe),
                    stdout=subprocess.DEVNULL,
                )
                pid = holder.pid
            _say(f"HOLDER {pid}")
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)

    anyio.run(main, backend=backend)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "config-after-disk-full":
        config_after_disk_full(*rest)
    elif mode == "die-holding-pipe":
        die_holding_pipe(*rest)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
