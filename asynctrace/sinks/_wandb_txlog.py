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
        self._pending: bytes | None = None  # the pieces of a record read so far
        self._suspect: int | None = None  # a chunk whose checksum failed once (see _chunk)
        self._lock = threading.Lock()
        self._decode: Callable[[bytes], Any] | None = None

    def poll(self) -> None:
        """Read what wandb-core appended since the last poll (nothing once `broken`)."""
        with self._lock:
            if self.broken is not None:
                return
            try:
                self._poll()
            except _Unreadable as exc:
                self.broken = f"{self.path.name}: {exc}"

    def _poll(self) -> None:
        if self._decode is None:
            self._decode = _record_type()
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._pos:
                    raise _Unreadable(f"the file shrank to {size} bytes after {self._pos} were read from it")
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            if self._pos:
                raise _Unreadable("the file is gone") from None
            return  # not written yet
        except OSError as exc:
            raise _Unreadable(f"the file cannot be read ({describe(exc)})") from exc
        if self._pos == 0:
            if len(data) < _HEADER:
                return  # wandb-core has not written the header yet
            if data[:_HEADER] != FORMAT:
                raise _Unreadable(f"its header {data[:_HEADER]!r} is not that of format {FORMAT!r}")
            self._pos = _HEADER
            data = data[_HEADER:]
        self._parse(data)

    def _parse(self, data: bytes) -> None:
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
                    break  # read while being written, maybe: again at the next poll
                at += _HEADER + length
                self._chunk(pos, kind, chunk)
        finally:
            self._pos += at

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
