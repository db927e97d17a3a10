"""TrackioSink: the default sink, logging traces to a Trackio project."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

from .._checks import check_bool, check_type
from .._records.types import TraceRecord
from .._runtime import forks
from .._runtime.abandon import Backlog, run_sync_daemon
from .._security import check_name, check_text, logger, shown
from ..exceptions import PermanentSinkError
from ._base import Sink
from ._trackio_versions import check_trackio_version
from ._trackio_writer import HEADER, TrackioWriter, WriteItem

__all__ = ["TrackioSink"]


_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

# Starts the writer with this same asynctrace first on its path, and without the current
# directory: `python -m` would put that first, so a directory holding another `asynctrace/`
# (a vendored or older checkout) would shadow this one. Portable to 3.10, which lacks `-P`.
_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] in ('', '.'):\n"
    "    del sys.path[0]\n"
    "sys.path.insert(0, sys.argv.pop(1))\n"
    "from asynctrace.sinks._trackio_worker import main\n"
    "sys.exit(main())\n"
)


def _pipe_fds(proc: anyio.abc.Process) -> tuple[tuple[int, tuple[int, int]], ...]:
    """This process's ends of the writer's stdin and stdout pipes, each with the identity of the
    pipe (device, inode) so that a number reused later is not mistaken for it.

    Best effort: anyio does not expose them, so they are found through the backend's process
    (a trio `FdStream`, or an asyncio pipe transport). Where none is found, the writer still
    notices its parent has gone (see `_trackio_worker`).
    """
    inner = getattr(proc, "_process", None)
    fds: list[tuple[int, tuple[int, int]]] = []
    for stream in (getattr(inner, "stdin", None), getattr(inner, "stdout", None)):
        fileno = getattr(stream, "fileno", None)
        if fileno is None:
            transport = getattr(stream, "transport", None) or getattr(stream, "_transport", None)
            pipe = transport.get_extra_info("pipe") if transport is not None else None
            fileno = getattr(pipe, "fileno", None)
        if callable(fileno):
            with contextlib.suppress(Exception):
                fd = int(fileno())
                st = os.fstat(fd)
                fds.append((fd, (st.st_dev, st.st_ino)))
    return tuple(fds)


# Trackio's rules for a project name (`SQLiteStorage.validate_project_name`, and the files
# named after it; the same in every supported release), written out here: they are checked
# when the sink is made, where importing Trackio would cost the caller a second or more, and a
# name it refuses would otherwise fail the sink's open, every record of the run with it. A test
# holds this copy to Trackio's own.
_REGISTRY_PREFIX = "registry-"
_RESERVED_SUFFIXES = tuple(
    f"_{table}"
    for table in (
        "system",
        "configs",
        "traces",
        "artifacts",
        "artifact_versions",
        "artifact_aliases",
        "run_artifact_links",
        "external_run_artifact_links",
    )
)
# A file name's limit (NAME_MAX) less the longest name Trackio derives from a project's:
# "<name>_external_run_artifact_links.parquet".
_MAX_PROJECT_FILE_BYTES = 255 - len("_external_run_artifact_links.parquet")


def check_trackio_project(project: str) -> None:
    """Refuse a project name Trackio would refuse when the run is opened, with a ValueError."""
    canonical = "".join(c for c in project if c.isalnum() or c in ("-", "_")).rstrip() or "default"
    if canonical.startswith(_REGISTRY_PREFIX):
        raise ValueError(
            f"project {shown(project)}: Trackio reserves names beginning with {_REGISTRY_PREFIX!r}"
        )
    for suffix in _RESERVED_SUFFIXES:
        if len(canonical) > len(suffix) and canonical.endswith(suffix):
            raise ValueError(
                f"project {shown(project)}: Trackio refuses names ending with {suffix!r} (its files "
                f"would collide with those of project {canonical[: -len(suffix)]!r})"
            )
    if len(canonical.encode()) > _MAX_PROJECT_FILE_BYTES:
        raise ValueError(
            f"project name is too long for Trackio's file names: at most {_MAX_PROJECT_FILE_BYTES} "
            f"bytes of letters, digits, '-' and '_', got {len(canonical.encode())}"
        )


def check_storable(value: Any, path: str, depth: int = 0) -> None:
    """Refuse, with a ValueError naming `path`, what Trackio could not store of `init_kwargs`
    (the run's config, its group): a lone surrogate in a string or key, or an int beyond 64
    bits. Trackio stores them with the first write, which then fails, every record with it.
    Walks the value as Trackio's `to_json_safe` converts it."""
    if depth > 100:
        return  # deeper than any config; Trackio's own conversion decides
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return
    if isinstance(value, str):
        check_text(path, value)
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"{path}: an int beyond 64 bits, which Trackio cannot store")
        return
    if type(value).__module__ == "numpy":
        item = getattr(value, "item", None)
        if callable(item) and getattr(value, "ndim", None) == 0:
            check_storable(item(), path, depth + 1)
            return
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = str(key)
            check_text(f"{path}: a key", name)
            check_storable(item, f"{path}[{shown(name)}]", depth + 1)
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            check_storable(item, f"{path}[{i}]", depth + 1)
        return
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return  # converted by the object's own code, when Trackio opens the run
    if hasattr(value, "__dict__"):
        public = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        check_storable(public, path, depth + 1)
        return
    try:
        text = str(value)
    except Exception:  # str() of an odd object fails: Trackio's problem, as before
        return
    check_text(path, text)


# Bytes per pipe write, and records per header slice, between turns of the event loop.
_SEND_SLICE = 64 * 1024
_HEADER_SLICE = 64


class TrackioSink(Sink):
    """Logs each batch as one Trackio log entry per step carrying a list of traces.

    Local mode (no `space_id` / `server_url`) reports a batch written once it is in Trackio's
    SQLite store: committed through Trackio's storage class where that is as expected, else
    logged through Trackio's public API and read back (`trackio_path`). By default Trackio runs
    in a writer process of its own, so its work never competes with the training loop for the
    GIL; ``process=False`` runs it in a worker thread instead.
    """

    def __init__(
        self,
        project: str | None = None,
        run: str | None = None,
        *,
        space_id: str | None = None,
        server_url: str | None = None,
        process: bool = True,
        init_kwargs: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        # Read from the installed package's metadata: Trackio itself is imported by the writer.
        check_trackio_version()
        for what, value in (("project", project), ("run", run)):
            if value is not None:
                check_name(what, value)
        if project is not None:
            check_trackio_project(project)
        check_type("space_id", space_id, str, "a str")
        check_type("server_url", server_url, str, "a str")
        check_bool("process", process)
        check_type("init_kwargs", init_kwargs, Mapping, "a mapping of trackio.init arguments")
        check_type("run_id", run_id, str, "a str (a Trackio run's id)")
        if run_id is not None:
            check_name("run_id", run_id)
        if init_kwargs is not None:
            check_storable(init_kwargs, "init_kwargs")
        self.name = "trackio"
        self.project = project
        self.run = run
        self.space_id = space_id
        self.server_url = server_url
        self.process = process
        self.init_kwargs = dict(init_kwargs or {})
        self.run_id = run_id
        self.finished = False
        self._writer: TrackioWriter | None = None
        self._proc: anyio.abc.Process | None = None
        self._backlog = Backlog("TrackioSink")
        self._reader: BufferedByteReceiveStream | None = None
        self._seq = itertools.count()
        self._broken = False
        self._open_seq: int | None = None  # the open request, until its reply is read
        self._inflight: tuple[object, int] | None = None  # (what, seq) of a request awaiting its reply
        # This process's ends of the writer's pipes: (fd, (st_dev, st_ino)).
        self._pipe_fds: tuple[tuple[int, tuple[int, int]], ...] = ()
        #: Replayed records that were already in Trackio and so were not written again.
        self.duplicates_skipped = 0
        #: How the sink writes to Trackio, once open: "private" (Trackio's storage class),
        #: "public" (its public API, read back) or "remote" (docs/sinks/trackio.md).
        self.trackio_path: str | None = None
        self._fallback_told = False

    def recovery_args(self) -> dict[str, Any] | None:
        # init_kwargs are left out: a config may hold anything, and the run exists already. The
        # server URL's credentials are left out where every spec is made (`_spec.describe_sinks`).
        return {
            "project": self.project,
            "run": self.run,
            "space_id": self.space_id,
            "server_url": self.server_url,
            "process": self.process,
        }

    def bind(self, project: str, run: str) -> None:
        if self.project is None:
            check_trackio_project(project)
        self.project = self.project or project
        self.run = self.run or run

    def _writer_args(self) -> dict[str, Any]:
        """The `TrackioWriter` arguments, as sent to the writer process too."""
        return {
            "project": self.project,
            "run": self.run,
            "space_id": self.space_id,
            "server_url": self.server_url,
            "init_kwargs": self.init_kwargs,
            "run_id": self.run_id,
        }

    async def open(self) -> None:
        if self.project is None or self.run is None:
            raise PermanentSinkError("TrackioSink needs a project and run (given or from the session)")
        if not self.process:
            self._writer = TrackioWriter(**self._writer_args())
            await run_sync_daemon(self._writer.open, backlog=self._backlog)
            self._note_path(self._writer.path, self._writer.fallback)
            return
        await self._ensure_open()

    def _note_path(self, path: object, fallback: object) -> None:
        """Keep how the writer writes; say once, when it is the public path, why."""
        if isinstance(path, str):
            self.trackio_path = path
        if path == "public" and not self._fallback_told:
            self._fallback_told = True
            logger.warning(
                "TrackioSink: writing to Trackio through its public API (run.log, each batch read "
                "back before it counts as written), since %s",
                fallback,
            )

    # -- the writer process ----------------------------------------------------------------
    #
    # A timed-out attempt does not make the process suspect: the writer may simply be busy
    # (starting Trackio takes seconds; a locked database makes a commit wait). The retry then
    # waits for the same request instead of sending it again or starting another process, so
    # a short attempt timeout still lets a slow start or a held lock come through. Only a
    # frame cut short in the pipe, or the process ending, means starting afresh.

    def _after_fork_in_child(self) -> None:
        """Point the child's copies of the writer's pipe ends at /dev/null.

        A forked child inherits this process's end of the writer's stdin; while any copy is
        open the writer never sees end of input, so after the trainer dies it would neither
        finish the run nor exit until the child did. The child never talks to the writer (its
        copy of the session refuses to log). The descriptors are redirected rather than closed so
        that the child's copies of the pipe objects, when collected, close /dev/null and not a
        descriptor the child has since opened for something else.
        """
        fds = []
        for fd, ident in self._pipe_fds:
            # The loop closes a dead writer's pipes on its own, and the number may since have
            # been reused for something else: only the very pipe recorded at spawn is redirected.
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == ident:
                fds.append(fd)
        if not fds:
            return
        try:
            devnull = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return
        for fd in fds:
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd, inheritable=False)
        os.close(devnull)

    async def _spawn(self) -> None:
        await self._kill()
        # The child must import this same asynctrace, wherever it was imported from here.
        self._proc = await anyio.open_process(
            [sys.executable, "-c", _BOOTSTRAP, _PACKAGE_PARENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
        )
        self._pipe_fds = _pipe_fds(self._proc)
        forks.hold(self, self._after_fork_in_child)
        assert self._proc.stdout is not None
        self._reader = BufferedByteReceiveStream(self._proc.stdout)
        self._broken = False
        self._inflight = None
        self._open_seq = await self._send(self._proc, {"op": "open", "writer": self._writer_args()})

    async def _ensure_open(self) -> None:
        if self._proc is None or self._proc.returncode is not None or self._broken:
            await self._spawn()
        if self._open_seq is not None:
            reply = await self._await_reply(self._open_seq)
            self._open_seq = None
            if not reply.get("ok"):
                self._broken = True  # the next attempt starts a fresh process
                _raise(reply)
            self._note_path(reply.get("path"), reply.get("fallback"))

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        self._open_seq = None
        self._inflight = None
        self._pipe_fds = ()
        if proc is None:
            return
        if proc.returncode is None:
            proc.kill()
        # One scope: shielded from the caller's cancellation, yet bounded by its own deadline
        # (a timeout outside a shielded scope would never reach the wait inside it).
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + 5):
            await proc.wait()
        await proc.aclose()

    async def _send(
        self, proc: anyio.abc.Process | None, header: dict[str, Any], payloads: Sequence[bytes] = ()
    ) -> int:
        if proc is None or proc.stdin is None:
            raise RuntimeError("the Trackio writer process is not running")
        seq = next(self._seq)
        header["seq"] = seq
        if payloads:
            header["blob"] = sum(len(p) for p in payloads)
        head = orjson.dumps(header)
        # A send cut short by a timeout leaves half a frame in the pipe; the next attempt
        # then starts a fresh writer process instead of talking to a confused one.
        self._broken = True
        # Sent in slices of about a pipe's capacity, with a turn for the event loop between
        # them: one joined copy of a whole batch would hold the training loop for a millisecond.
        await proc.stdin.send(HEADER.pack(len(head)) + head)
        chunk: list[bytes] = []
        size = 0
        for payload in payloads:
            chunk.append(payload)
            size += len(payload)
            if size >= _SEND_SLICE:
                await proc.stdin.send(b"".join(chunk))
                await anyio.lowlevel.checkpoint()
                chunk, size = [], 0
        if chunk:
            await proc.stdin.send(b"".join(chunk))
        self._broken = False
        return seq

    async def _await_reply(self, seq: int) -> dict[str, Any]:
        reader = self._reader
        if reader is None:
            raise RuntimeError("the Trackio writer process is not running")
        while True:
            try:
                line = await reader.receive_until(b"\n", 1 << 20)
            except (
                anyio.EndOfStream,
                anyio.IncompleteRead,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
            ) as exc:
                self._broken = True
                raise RuntimeError("the Trackio writer process exited") from exc
            reply: dict[str, Any] = orjson.loads(line)
            # Replies to requests given up on earlier are skipped; the worker answers in order.
            if reply.get("seq") == seq:
                return reply

    async def _call(
        self, key: object, header: dict[str, Any], payloads: Sequence[bytes] = ()
    ) -> dict[str, Any]:
        """Send a request, or keep waiting for it if a timed-out attempt already sent it."""
        await self._ensure_open()
        inflight = self._inflight
        if inflight is not None and inflight[0] is key:
            seq = inflight[1]
        else:
            seq = await self._send(self._proc, header, payloads)
            self._inflight = (key, seq)
        reply = await self._await_reply(seq)
        self._inflight = None
        if not reply.get("ok"):
            _raise(reply)
        return reply

    def _opened(self) -> TrackioWriter:
        if self._writer is None:
            raise RuntimeError("TrackioSink is not open")
        return self._writer

    async def write(self, records: Sequence[TraceRecord]) -> None:
        if not self.process:
            writer = self._opened()
            items = [WriteItem(r.id, r.step, r.key, r.payload, r.replayed, r.timestamp) for r in records]
            skipped = await run_sync_daemon(writer.write, items, backlog=self._backlog)
            self.duplicates_skipped += skipped
            self._note_path(writer.path, writer.fallback)
            return
        # One list per field, not one per record: a write's header then adds six objects
        # for the garbage collector to track, however many records it carries.
        columns: dict[str, list[Any]] = {
            "ids": [],
            "steps": [],
            "keys": [],
            "sizes": [],
            "replayed": [],
            "timestamps": [],
        }
        for start in range(0, len(records), _HEADER_SLICE):
            if start:
                await anyio.lowlevel.checkpoint()
            part = records[start : start + _HEADER_SLICE]
            columns["ids"] += [r.id for r in part]
            columns["steps"] += [r.step for r in part]
            columns["keys"] += [r.key for r in part]
            columns["sizes"] += [len(r.payload) for r in part]
            columns["replayed"] += [int(r.replayed) for r in part]
            columns["timestamps"] += [r.timestamp for r in part]
        reply = await self._call(records, {"op": "write", **columns}, [r.payload for r in records])
        self.duplicates_skipped += int(reply.get("skipped", 0))
        self._note_path(reply.get("path"), reply.get("fallback"))

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.process:
            await run_sync_daemon(self._opened().write_metrics, step, metrics, backlog=self._backlog)
            return
        await self._call(metrics, {"op": "metrics", "step": step, "metrics": dict(metrics)})

    async def close(self) -> None:
        if not self.process:
            if self._writer is not None:
                await run_sync_daemon(self._writer.finish)
                self.finished = self._writer.finished
            return
        proc, self._proc = self._proc, None
        self._pipe_fds = ()
        if proc is None:
            return
        try:
            if proc.returncode is None and not self._broken:
                reply = await self._await_reply(await self._send(proc, {"op": "finish"}))
                if not reply.get("ok"):
                    _raise(reply)
                self.finished = True
        finally:
            # End of input makes the writer finish its run (if the request above did not
            # get through in time) and exit on its own, even after this process is gone.
            with anyio.CancelScope(shield=True):
                if proc.stdin is not None:
                    with contextlib.suppress(Exception):
                        await proc.stdin.aclose()
                if self.finished:
                    with anyio.move_on_after(5):
                        await proc.wait()


def _raise(reply: Mapping[str, Any]) -> None:
    message = f"Trackio writer: {reply.get('error')}"
    if reply.get("permanent"):
        raise PermanentSinkError(message)
    raise RuntimeError(message)
