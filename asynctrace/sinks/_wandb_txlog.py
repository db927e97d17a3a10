"""What a W&B run's `.wandb` transaction log holds: the sink's proof that logged rows are persisted.

`run.log` only hands data to the `wandb-core` service process, which buffers the log in memory
and writes it to the `.wandb` file every ``x_transaction_log_flush_interval`` seconds (or when a
32 KiB block fills, or when the run finishes). W&B offers no request that waits for that write, so
the sink reads the file back: a table increment is persisted once its history record is in it.

The file's format is W&B's own and private (a LevelDB log of wandb's `Record` protocol buffers).
The reader trusts only what it can check: the header (`:W&B`, its magic number, format version
0), each chunk's CRC-32, the chunk kinds of a LevelDB log, and records that decode as wandb's
`Record`. Bytes that fail any of these (a format change in a later wandb, a damaged or truncated
file, a wandb without the `Record` type) stop it for good, `broken` saying why: it never guesses,
so nothing it could not check ever counts a row persisted. Record kinds it does not know (W&B
adds some now and then) are skipped: they hold no table increment of the sink's.

A log that is there already when the reader first looks (an attached run of a long training job
can have written gigabytes) is read from near its end: from a block boundary at most `_TAIL`
bytes before it, skipping the pieces of a record begun before that boundary. Every row the sink
logs after that first look is written past it (wandb-core appends what it gets in order), and
reading less of the file can only confirm less, never more. Each poll reads at most `_POLL`
bytes, `_READ` at a time, so neither the first look nor a catch-up holds much in memory.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from .._security import describe

__all__ = ["FORMAT", "LogTail"]

# A LevelDB log: 32 KiB blocks of framed chunks (CRC, length, kind), after a 7-byte W&B header
# that is part of the first block.
_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
# How much of an existing log the first poll reads (enough records to check the format before a
# row is handed over); the most one read takes in (a chunk never spans blocks, so any whole
# chunk fits); the most one poll reads.
_TAIL = 8 * _BLOCK
_READ = 32 * _BLOCK
_POLL = 8 * _READ
#: The header of the one `.wandb` format the reader knows: ident, magic number, version.
FORMAT = b":W&B" + struct.pack("<HB", 0xBEE1, 0)


class _Unreadable(Exception):
    """Bytes of the log the reader cannot check or decode."""


def _record_type() -> Callable[[bytes], Any]:
    """wandb's `Record` parser (imported on first use, in the polling thread)."""
    try:
        from wandb.proto import wandb_internal_pb2 as pb

        return pb.Record.FromString  # type: ignore[attr-defined, no-any-return]
    except Exception as exc:  # no wandb.proto, no Record: a wandb this reader does not know
        raise _Unreadable(f"wandb's Record type cannot be loaded ({describe(exc)})") from exc


def _start_of(size: int) -> int:
    """Where to read a log of `size` bytes from: the block boundary at most `_TAIL` bytes before
    its end (0, the header, for a short one)."""
    return max(0, size - _TAIL) // _BLOCK * _BLOCK


class LogTail:
    """Follows a `.wandb` file as wandb-core appends to it.

    `files` holds the table file of every table increment whose history record it holds,
    `reached[key]` how many increments of the incremental table logged under `key` it holds (its
    highest ``increment_num`` + 1), `last_step` the highest history step it holds, `finished`
    whether it holds the run's exit record; `broken`, once set, why it stopped reading.

    `poll` does blocking file I/O: call it off the event loop. Calls are serialised, so a poll
    abandoned by a deadline and the next one never interleave.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reached: dict[str, int] = {}
        self.files: set[str] = set()
        self.last_step = -1
        self.finished = False
        self.broken: str | None = None
        self._pos = 0  # the file offset read up to: 0 until the header is checked
        self._start: int | None = None  # where reading begins, fixed by the first poll
        self._resync = False  # skipping the rest of a record begun before `_start`
        self._pending: bytes | None = None  # the pieces of a record read so far
        self._suspect: int | None = None  # a chunk whose checksum failed once (see _chunk)
        self._lock = threading.Lock()
        self._decode: Callable[[bytes], Any] | None = None

    def poll(self) -> bool:
        """Read what wandb-core appended since the last poll (nothing once `broken`), at most
        `_POLL` bytes of it; False when more was there already (poll again)."""
        with self._lock:
            if self.broken is not None:
                return True
            try:
                return self._poll()
            except _Unreadable as exc:
                self.broken = f"{self.path.name}: {exc}"
                return True

    def _poll(self) -> bool:
        if self._decode is None:
            self._decode = _record_type()
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self._start is None:
                    self._start = _start_of(size)
                if size < self._pos:
                    raise _Unreadable(f"the file shrank to {size} bytes after {self._pos} were read from it")
                if self._pos == 0 and not self._header(f.read(_HEADER)):
                    return True
                end = min(size, self._pos + _POLL)
                while self._pos < end:
                    f.seek(self._pos)
                    before = self._pos
                    if not self._parse(f.read(min(end - self._pos, _READ))):
                        return True  # a chunk to read again at the next poll
                    if self._pos == before:
                        break  # a chunk cut at `end`: not all written yet, or past this poll's part
                return end == size
        except FileNotFoundError:
            if self._pos:
                raise _Unreadable("the file is gone") from None
            if self._start is None:
                self._start = 0  # not written yet: all of it is to come
            return True
        except OSError as exc:
            raise _Unreadable(f"the file cannot be read ({describe(exc)})") from exc

    def _header(self, header: bytes) -> bool:
        """Check the file's header; False while wandb-core has not written it all."""
        if len(header) < _HEADER:
            return False
        if header != FORMAT:
            raise _Unreadable(f"its header {header!r} is not that of format {FORMAT!r}")
        assert self._start is not None  # set by the poll before
        self._pos = max(_HEADER, self._start)
        self._resync = self._pos > _HEADER
        return True

    def _parse(self, data: bytes) -> bool:
        """Read the whole chunks of `data` (the file from `_pos` on); False when it stopped at
        one whose checksum failed, to be read again at the next poll, not at once."""
        at = 0  # offset in `data`; the file offset is self._pos + at
        try:
            while True:
                pos = self._pos + at
                left = _BLOCK - pos % _BLOCK
                if left < _HEADER:
                    if at + left > len(data):
                        break  # the block's padding is not all written yet
                    at += left  # a block's tail too short for a chunk header is padding
                    continue
                if at + _HEADER > len(data):
                    break
                crc, length, kind = struct.unpack("<IHB", data[at : at + _HEADER])
                if kind == 0 and crc == 0 and length == 0:
                    # Zeros: the rest of the block is padding (LevelDB's preallocated space).
                    if at + left > len(data):
                        break
                    at += left
                    continue
                if _HEADER + length > left:
                    raise _Unreadable(f"the chunk at byte {pos} runs past its block")
                if at + _HEADER + length > len(data):
                    break  # wandb-core has not written this chunk whole yet
                chunk = data[at + _HEADER : at + _HEADER + length]
                if not self._checked(pos, crc, kind, chunk):
                    return False  # read while being written, maybe: again at the next poll
                at += _HEADER + length
                self._chunk(pos, kind, chunk)
        finally:
            self._pos += at
        return True

    def _checked(self, pos: int, crc: int, kind: int, chunk: bytes) -> bool:
        """Whether the chunk's CRC-32 (of its kind byte and data) matches. A mismatch is read
        again at the next poll, in case the read raced wandb-core's write; a second one at the
        same place is a damaged file or a format the reader does not know."""
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc:
            self._suspect = None
            return True
        if self._suspect == pos:
            raise _Unreadable(f"the chunk at byte {pos} fails its checksum")
        self._suspect = pos
        return False

    def _chunk(self, pos: int, kind: int, chunk: bytes) -> None:
        """One checked chunk: a whole record, or a piece of one (first, middle, last)."""
        if self._resync:
            if kind in (_MIDDLE, _LAST):
                return  # the rest of a record begun before the reader's start: not the sink's
            self._resync = False
        if kind == _FULL and self._pending is None:
            self._note(chunk)
        elif kind == _FIRST and self._pending is None:
            self._pending = chunk
        elif kind == _MIDDLE and self._pending is not None:
            self._pending += chunk
        elif kind == _LAST and self._pending is not None:
            raw, self._pending = self._pending + chunk, None
            self._note(raw)
        else:
            raise _Unreadable(f"the chunk at byte {pos} has kind {kind}, unknown or out of place")

    def _note(self, raw: bytes) -> None:
        assert self._decode is not None  # loaded by _poll
        try:
            record = self._decode(raw)
            kind = record.WhichOneof("record_type")
            if kind == "exit":
                self.finished = True
            elif kind == "history":
                self._history(record.history)
        except _Unreadable:
            raise
        except Exception as exc:  # a record of another shape than the one this reader knows
            raise _Unreadable(f"a record does not decode as wandb's Record ({describe(exc)})") from exc

    def _history(self, history: Any) -> None:
        for item in history.item:
            nested = item.nested_key
            if len(nested) != 2:
                continue
            if nested[1] == "increment_num":
                reached = int(item.value_json) + 1
                if reached > self.reached.get(nested[0], 0):
                    self.reached[nested[0]] = reached
            elif nested[1] == "path":
                path = orjson.loads(item.value_json)
                if isinstance(path, str):
                    self.files.add(path)
        # Written after its items: a step's rows are in `files` once `last_step` says so.
        self.last_step = max(self.last_step, int(history.step.num))
