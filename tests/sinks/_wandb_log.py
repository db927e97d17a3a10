"""Reading back what an offline W&B run wrote (its table files, the history in its `.wandb` log),
and writing `.wandb` files of our own to feed the sink's reader."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

# The `.wandb` transaction log is a LevelDB log (32 KiB blocks of framed chunks) after a 7-byte
# header; each record is one of wandb's own `Record` protocol buffers.
_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out: list[bytes] = []
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left  # a block's tail too short for a chunk header is padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:
            pos += left
            continue
        if pos + _HEADER + length > len(data):
            break  # the service is still writing this chunk
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
    return out


def history(run_dir: Path, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The history rows of the finished run in `run_dir`, in order: each a dict of key to value.

    The service writes the log on its own after `finish()` returns: this waits (at most
    `timeout` seconds) for the run's exit record.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = [pb.Record.FromString(raw) for raw in _records(log)]
        except DecodeError:
            # Read while the service was mid-write: a record whose bytes are not all there yet.
            if time.monotonic() > deadline:
                raise
            records = []
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "exit" in kinds, f"{log} has no exit record after {timeout}s"
    rows = []
    for record, kind in zip(records, kinds, strict=True):
        if kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def table_rows(files_dir: Path, key: str) -> list[dict[str, Any]]:
    """The rows of every table file logged under `key` (a name such as ``traces/default-incr``)."""
    folder, _, name = key.rpartition("/")
    rows = []
    for path in sorted((files_dir / "media" / "table" / folder).glob(f"{name}_*.table.json")):
        data = json.loads(path.read_text())
        rows += [dict(zip(data["columns"], row, strict=True)) for row in data["data"]]
    return rows


def increments(log: Path, key: str = "train/traces-incr") -> int:
    """How many increments of the incremental table logged under `key` the `.wandb` file `log`
    holds now (whole records only): its highest ``increment_num`` + 1."""
    from wandb.proto import wandb_internal_pb2 as pb

    reached = 0
    for raw in _records(log):
        record = pb.Record.FromString(raw)
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                if list(item.nested_key) == [key, "increment_num"]:
                    reached = max(reached, int(item.value_json) + 1)
    return reached


def records(log: Path) -> list[bytes]:
    """The records of the `.wandb` file `log` (whole ones only), as bytes."""
    return _records(log)


def frame(items: list[bytes | tuple[int, bytes]], header: bytes | None = None) -> bytes:
    """A `.wandb` file's bytes: `header` (W&B's own by default), then each item: a record
    (bytes, split across blocks as W&B does) or a raw chunk (its kind, its data), checksummed."""
    out = bytearray(header if header is not None else b":W&B" + struct.pack("<HB", 0xBEE1, 0))

    def chunk(kind: int, data: bytes) -> None:
        crc = zlib.crc32(data, zlib.crc32(bytes([kind])))
        out.extend(struct.pack("<IHB", crc, len(data), kind) + data)

    for item in items:
        if isinstance(item, tuple):
            chunk(*item)
            continue
        data, first = item, True
        while True:
            left = _BLOCK - len(out) % _BLOCK
            if left < _HEADER:
                out.extend(b"\0" * left)
                continue
            piece, data = data[: left - _HEADER], data[left - _HEADER :]
            last = not data
            chunk(_FULL if first and last else _FIRST if first else _LAST if last else _MIDDLE, piece)
            if last:
                break
            first = False
    return bytes(out)
