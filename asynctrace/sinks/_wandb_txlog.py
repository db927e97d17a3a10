"""What a W&B run's `.wandb` transaction log holds: the sink's proof that logged rows are persisted.

`run.log` only hands data to the `wandb-core` service process, which buffers the log in memory
and writes it to the `.wandb` file every ``x_transaction_log_flush_interval`` seconds (or when a
32 KiB block fills, or when the run finishes). W&B offers no request that waits for that write, so
the sink reads the file back: a table increment is persisted once its history record is in it.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Any

import orjson

__all__ = ["LogTail"]

# A LevelDB log: 32 KiB blocks of framed chunks (CRC, length, kind), after a 7-byte W&B header
# that is part of the first block.
_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class LogTail:
    """Follows a `.wandb` file as wandb-core appends to it: `files` holds the table file of every
    table increment whose history record it holds, `reached[key]` how many increments of the
    incremental table logged under `key` it holds (its highest ``increment_num`` + 1).

    `poll` does blocking file I/O: call it off the event loop. Calls are serialised, so a poll
    abandoned by a deadline and the next one never interleave.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reached: dict[str, int] = {}
        self.files: set[str] = set()
        self._pos = _HEADER
        self._pending = b""
        self._lock = threading.Lock()
        self._record: Any = None

    def poll(self) -> None:
        """Read what wandb-core appended since the last poll."""
        with self._lock:
            try:
                with self.path.open("rb") as f:
                    f.seek(self._pos)
                    data = f.read()
            except FileNotFoundError:
                return
            self._parse(data)

    def _parse(self, data: bytes) -> None:
        at = 0  # offset in `data`; the file offset is self._pos + at
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
            _crc, length, kind = struct.unpack("<IHB", data[at : at + _HEADER])
            if kind == 0:
                if at + left > len(data):
                    break
                at += left
                continue
            if at + _HEADER + length > len(data):
                break  # wandb-core has not written this chunk whole yet
            chunk = data[at + _HEADER : at + _HEADER + length]
            at += _HEADER + length
            if kind == _FULL:
                self._note(chunk)
                self._pending = b""
            elif kind == _FIRST:
                self._pending = chunk
            elif kind == _MIDDLE:
                self._pending += chunk
            elif kind == _LAST:
                self._note(self._pending + chunk)
                self._pending = b""
        self._pos += at

    def _note(self, raw: bytes) -> None:
        if self._record is None:
            from wandb.proto import wandb_internal_pb2 as pb

            self._record = pb.Record  # type: ignore[attr-defined]
        record = self._record.FromString(raw)
        if record.WhichOneof("record_type") != "history":
            return
        for item in record.history.item:
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
