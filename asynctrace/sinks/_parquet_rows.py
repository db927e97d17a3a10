"""ParquetSink's rows: journal lines in, Arrow tables of the archive's schema out.

A journal line is ``{"id":...,"step":...,"split":...,"key":...,"timestamp":...,"sample":<payload>}``
with the payload as it was encoded at submission. Columns are built from the lines without a
Python object per JSON value of the conversation: the ``messages`` text is cut out of the payload
as it is, and the metadata's typed fields are read by pyarrow's JSON reader; a batch the sink
wrote comes with its layout (`journal_lines`), which cuts it without a Python step per line.
`_parquet_file` turns these tables into a file's row groups.
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Container, Sequence
from typing import Any, NamedTuple

import orjson

from .._checks import int64_or_none
from .._records.tokens import TOKEN_FIELDS, token_bytes
from ._parquet_tokens import Decoder, token_spans

__all__ = ["SAMPLE_KEY", "RowBuffer", "journal_lines", "journal_parts", "pyarrow", "schema"]

_ARROW_TYPES = {"int32": "int32", "int8": "int8", "float32": "float32"}
_SAMPLE = b',"sample":'
_MESSAGES = b'{"messages":['
_METADATA = b',"metadata":{'
_TAIL = 1024
SAMPLE_KEY = _SAMPLE  # where a journal line's header ends


def pyarrow() -> Any:
    """pyarrow with the modules the sink uses, or an ImportError naming the extra."""
    try:
        import numpy  # noqa: F401 - pyarrow's own dependency, imported here once
        import pyarrow as pa
        import pyarrow.compute
        import pyarrow.json
        import pyarrow.parquet  # loads pa.parquet
    except ImportError as exc:
        raise ImportError('ParquetSink needs pyarrow: pip install "asynctrace[parquet]"') from exc
    return pa


@functools.cache
def schema() -> Any:
    """The one schema of every file a `ParquetSink` writes."""
    pa = pyarrow()
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("messages", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("policy_version", pa.int64()),
        pa.field("stop_reason", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("spans", pa.string()),
    ]
    for name, dtype in TOKEN_FIELDS.items():
        fields.append(pa.field(name, pa.list_(getattr(pa, _ARROW_TYPES[dtype])())))
    return pa.schema(fields)


def journal_parts(records: Sequence[Any]) -> tuple[list[bytes], dict[str, Any]]:
    """The journal lines of `records` (`TraceRecord`s) as pieces to write one after another (each
    payload as it is, never copied into a joined buffer), and their layout: what the writer
    process needs to cut the lines without reading their headers."""
    dumps = orjson.dumps
    parts: list[bytes] = []
    append = parts.append
    heads: list[int] = []
    sizes: list[int] = []
    runs: list[list[Any]] = []
    # Records of one call share step, split, key and timestamp: that part of the line is built
    # once per run of equal ones.
    last: tuple[int, str, str, float] | None = None
    tail = b""
    close = b""  # the previous line's end, written with this line's head: two pieces a line
    for r in records:
        fields = (r.step, r.split, r.key, r.timestamp)
        if fields != last:
            last = fields
            tail = b',"step":%d,"split":%b,"key":%b,"timestamp":%b,"sample":' % (
                r.step,
                dumps(r.split),
                dumps(r.key),
                dumps(r.timestamp),
            )
            runs.append([0, *fields])
        runs[-1][0] += 1
        head = b'{"id":' + dumps(r.id) + tail
        append(close + head)
        append(r.payload)
        close = b"}\n"
        heads.append(len(head))
        sizes.append(len(r.payload))
    if records:
        append(close)
    layout = {"heads": heads, "sizes": sizes, "ids": [r.id for r in records], "runs": runs}
    return parts, layout


def journal_lines(records: Sequence[Any]) -> tuple[bytes, dict[str, Any]]:
    """`journal_parts` joined: the lines as one buffer."""
    parts, layout = journal_parts(records)
    return b"".join(parts), layout


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _string_column(pa: Any, pieces: list[Any]) -> Any:
    """A string column from each row's UTF-8 bytes: one join, offsets, checked in C++."""
    data = b"".join(pieces)
    if len(data) >= 2**31:
        return pa.array([bytes(p).decode() for p in pieces], pa.string())
    offsets = array.array("i", itertools.accumulate(map(len, pieces), initial=0))
    column = pa.StringArray.from_buffers(len(pieces), pa.py_buffer(offsets), pa.py_buffer(data))
    column.validate(full=True)  # a payload that is not UTF-8 fails here, not in a reader
    return column


def _list_column(pa: Any, dtype: str, values: list[bytes | None]) -> Any:
    """A list column from each row's little-endian bytes: one buffer, offsets, and nulls where absent."""
    item = getattr(pa, _ARROW_TYPES[dtype])()
    width = item.bit_width // 8
    offsets = array.array("i", itertools.accumulate((len(v) // width if v else 0 for v in values), initial=0))
    data = pa.py_buffer(b"".join(v for v in values if v))
    flat = pa.Array.from_buffers(item, offsets[-1], [None, data])
    valid = bytearray((len(values) + 7) // 8)
    for i, v in enumerate(values):
        if v is not None:
            valid[i >> 3] |= 1 << (i & 7)
    return pa.Array.from_buffers(
        pa.list_(item), len(values), [pa.py_buffer(valid), pa.py_buffer(offsets)], children=[flat]
    )


def _numbers(pa: Any, values: Any, kind: Any) -> Any:
    """An Arrow array over a numpy array's memory (not `pa.array`, which imports pandas)."""
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _repeated(pa: Any, runs: list[tuple[str, int]]) -> Any:
    """A string column of `runs`: (value, how many rows) each."""
    pieces = [value.encode() for value, count in runs for _ in range(count)]
    return _string_column(pa, pieces)


@functools.cache
def _meta_schema(pa: Any) -> Any:
    """The metadata's typed fields, as pyarrow's JSON reader reads them."""
    floats, ints = pa.float64(), pa.int64()
    fields = [("reward", floats), ("advantage", floats), ("policy_version", ints)]
    return pa.schema([*fields, ("policy_version_max", ints), ("stop_reason", pa.string())])


class RowBuffer:
    """Journal lines parsed into Arrow tables, until `table()` hands them over as one."""

    def __init__(self) -> None:
        self.rows = 0
        self.nbytes = 0
        self.damaged = 0  # lines left out that were not a record's JSON
        self._segments: list[Any] = []

    def add(self, chunk: bytes, skip: Container[str] = ()) -> None:
        """Take the lines of `chunk` (whole lines, each ending in a newline) but those whose id is
        skipped; a damaged line (not a record's JSON) is left out and counted in `damaged`."""
        if not chunk.endswith(b"\n"):
            raise ValueError("a journal chunk must end with a whole line")
        pa = pyarrow()
        try:
            segment = _quick_segment(chunk, skip)
        except (pa.ArrowInvalid, OverflowError):  # not UTF-8, a step past int64: the exact path finds it
            segment = None
        if segment is None:
            segment, damaged = _exact_segment(chunk, skip)
            self.damaged += damaged
        self.take(segment, len(chunk))

    def add_described(self, chunk: bytes, layout: dict[str, Any]) -> None:
        """Take the lines of `chunk`, which `journal_lines` wrote with this `layout`."""
        segment = _described_segment(chunk, layout)
        if segment is None:
            self.add(chunk)
        else:
            self.take(segment, len(chunk))

    def take(self, segment: Any, nbytes: int) -> None:
        """Take the rows of a table of `schema()`, read from `nbytes` of the journal."""
        if segment.num_rows:
            self._segments.append(segment)
            self.rows += segment.num_rows
        self.nbytes += nbytes

    def table(self) -> Any:
        """The rows held as one table of `schema()`; the buffer is empty after."""
        pa = pyarrow()
        segments, self._segments = self._segments, []
        self.rows = self.nbytes = 0
        return pa.concat_tables(segments) if segments else schema().empty_table()


def _table(pa: Any, columns: dict[str, Any]) -> Any:
    target = schema()
    return pa.Table.from_arrays([columns[name] for name in target.names], schema=target)


def _head_columns(
    pa: Any, ids: list[str], steps: list[int], splits: list[str], keys: list[str], times: list[int]
) -> dict[str, Any]:
    strings = pa.string()
    return {
        "id": pa.array(ids, strings),
        "step": pa.array(steps, pa.int64()),
        "split": pa.array(splits, strings),
        "key": pa.array(keys, strings),
        "timestamp": pa.array(times, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    }


def _quick_segment(chunk: bytes, skip: Container[str]) -> Any:
    """The chunk's rows where every payload is ``{"messages":[...],"metadata":{...}}`` (what the
    session encodes for a sample without score, spans or token fields): the messages' and the
    metadata's JSON are taken as they were encoded, and the metadata's typed fields are read by
    pyarrow's JSON reader. None where any line is otherwise: `_exact_segment` then decodes each.
    """
    pa = pyarrow()
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    view = memoryview(chunk)
    find, rfind, startswith = chunk.find, chunk.rfind, chunk.startswith
    ids: list[str] = []
    steps: list[int] = []
    splits: list[str] = []
    keys: list[str] = []
    times: list[int] = []
    messages: list[Any] = []
    metadata: list[Any] = []
    last = b""
    step, split, key, when = 0, "", "", 0
    pos, end = 0, len(chunk)
    while pos < end:
        newline = find(b"\n", pos)
        cut = find(_SAMPLE, pos, newline)
        # The first `,"sample":` (or `,"step":`) of a line is its key: no JSON string holds `,"`
        # unescaped. An id written without escapes is read as it is.
        middle = find(b'","step":', pos, cut) + 1
        if middle <= 0 or not startswith(b'{"id":"', pos) or chunk[newline - 2 : newline] != b"}}":
            return None
        raw = chunk[pos + 7 : middle - 1]
        if b"\\" in raw:
            return None
        tail = chunk[middle:cut]
        if tail != last:
            try:
                head = loads(b"{" + tail[1:] + b"}")
            except decode_error:
                return None
            step, split, key, when = (
                head.get("step"),
                head.get("split"),
                head.get("key"),
                head.get("timestamp"),
            )
            if type(step) is not int or type(split) is not str or type(key) is not str:
                return None
            if type(when) is not float and type(when) is not int:
                return None
            when = int(when * 1_000_000)
            last = tail
        start, stop = cut + len(_SAMPLE), newline - 2  # the payload's closing brace is at `stop`
        if not startswith(_MESSAGES, start):
            return None
        # The metadata is the payload's second key, usually near its end.
        found = rfind(_METADATA, max(start, stop - 1024), stop)
        if found < 0:
            found = find(_METADATA, start, stop)
            if found < 0:
                return None
        pos = newline + 1
        try:
            rid = raw.decode()
        except UnicodeDecodeError:
            return None
        if rid in skip:
            continue
        ids.append(rid)
        steps.append(step)
        splits.append(split)
        keys.append(key)
        times.append(when)
        messages.append(view[start + 12 : found])
        metadata.append(view[found + 12 : stop])
    if not ids:
        return schema().empty_table()
    # Each metadata text must be one JSON object. Were the `,"metadata":{` found not the payload's
    # own key (one deeper, in the messages or the metadata) or were other keys after it, the
    # object read from there would be followed by more text on its line, which fails here: the
    # exact path then takes the chunk. So the messages' text, before it, is theirs too.
    texts = _string_column(pa, metadata)
    typed = _metadata_fields(pa, pa.py_buffer(b"\n".join(metadata) + b"\n"), texts)
    if typed is None:
        return None
    columns = _head_columns(pa, ids, steps, splits, keys, times)
    columns.update(_empty_rest(pa, len(ids)))
    columns.update(messages=_string_column(pa, messages), metadata=texts, **typed)
    return _table(pa, columns)


def _described_segment(chunk: bytes, layout: dict[str, Any]) -> Any:
    """The chunk's rows, cut by their `layout` (from `journal_lines`) without decoding their JSON,
    where every payload is ``{"messages":[...],"metadata":{...}}``, with or without token fields
    after (``,"tokens":{...}``, `_parquet_tokens`); None otherwise."""
    import numpy as np

    pa = pyarrow()
    import pyarrow.compute as pc

    heads = np.asarray(layout["heads"], np.int64)
    n = len(heads)
    lengths = heads + np.asarray(layout["sizes"], np.int64) + 2
    ends = np.cumsum(lengths)
    if not n or int(ends[-1]) != len(chunk) or len(chunk) >= 2**31 - 1:
        return None
    data = np.frombuffer(chunk, np.uint8)
    payloads = ends - lengths + heads
    closes = ends - 3  # each payload's closing brace
    pattern = np.frombuffer(_MESSAGES, np.uint8)
    if not (data[payloads[:, None] + np.arange(len(pattern))] == pattern).all():
        return None
    if not ((data[ends - 1] == 0x0A) & (data[ends - 2] == 0x7D) & (data[closes] == 0x7D)).all():
        return None
    # Where each payload's metadata object ends: at its closing brace, or before its token fields.
    # Only a payload ending `"}}}` can end in token fields.
    bounds = closes.copy()
    tokens: dict[str, list[bytes | None]] = {}
    maybe = (data[closes - 1] == 0x7D) & (data[closes - 2] == 0x7D) & (data[closes - 3] == 0x22)
    if maybe.any():
        view = memoryview(chunk)
        decoder = Decoder()
        for i in np.flatnonzero(maybe).tolist():
            walked = token_spans(chunk, int(payloads[i]), int(closes[i]))
            if walked is None:
                continue  # the metadata's own end (its text is checked below)
            bounds[i], spans = walked
            for name, (first, last) in spans.items():
                raw = decoder.field(name, view[first:last])
                if raw is None:
                    return None
                tokens.setdefault(name, [None] * n)[i] = raw

    # The metadata is the payload's second key, usually near the end of what precedes the token
    # fields: the last one in the `_TAIL` bytes before that end (a row where there is none goes
    # the exact way; one found deeper leaves a text that is no object, checked below).
    rfind = chunk.rfind
    lows = np.maximum(payloads + len(_MESSAGES), bounds - _TAIL).tolist()
    found = [rfind(_METADATA, low, high) for low, high in zip(lows, bounds.tolist(), strict=True)]
    if min(found) < 0:
        return None
    metadata_at = np.asarray(found, np.int64)
    buffer = pa.py_buffer(chunk)

    def cut(first: Any, last: Any) -> Any:
        # The spans as the even values of one binary array over the chunk (the odd ones are
        # what lies between), taken into an array of their own.
        edges = np.empty(2 * n, np.int32)
        edges[0::2], edges[1::2] = first, last
        spans = pa.Array.from_buffers(pa.binary(), 2 * n - 1, [None, pa.py_buffer(edges), buffer])
        return pc.take(spans, _numbers(pa, np.arange(0, 2 * n, 2, dtype=np.int64), pa.int64()))

    try:
        messages = cut(payloads + len(_MESSAGES) - 1, metadata_at).cast(pa.string())
        metadata = cut(metadata_at + len(_METADATA) - 1, bounds).cast(pa.string())
    except pa.ArrowInvalid:
        return None  # not UTF-8: the exact path names the record
    # The texts back to back: the JSON reader reads one object after another, and a text cut
    # wrongly (more than one object, or one and more) leaves it unable to, or with more rows.
    offsets = np.frombuffer(metadata.buffers()[1], np.int32, n + 1, metadata.offset * 4)
    texts = metadata.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    typed = _metadata_fields(pa, texts, metadata)
    if typed is None:
        return None
    runs = layout["runs"]
    counts = [run[0] for run in runs]
    steps = np.repeat(np.asarray([run[1] for run in runs], np.int64), counts)
    times = np.repeat(np.asarray([int(run[4] * 1_000_000) for run in runs], np.int64), counts)
    columns = {
        "id": _string_column(pa, [rid.encode() for rid in layout["ids"]]),
        "step": _numbers(pa, steps, pa.int64()),
        "split": _repeated(pa, [(run[2], run[0]) for run in runs]),
        "key": _repeated(pa, [(run[3], run[0]) for run in runs]),
        "timestamp": _numbers(pa, times, pa.timestamp("us", tz="UTC")),
        "messages": messages,
        "metadata": metadata,
        **_empty_rest(pa, n),
        **typed,
    }
    for name, values in tokens.items():
        columns[name] = _list_column(pa, TOKEN_FIELDS[name], values)
    return _table(pa, columns)


def _metadata_fields(pa: Any, lines: Any, metadata: Any) -> dict[str, Any] | None:
    """The typed columns from the metadata's JSON (`lines`: a buffer of one object after another,
    the texts of the `metadata` column); None where they are not one object a row (a text was
    cut wrongly) or a field is not of its column's type: the exact path decides those."""
    import pyarrow.compute as pc
    import pyarrow.json as pj

    n = len(metadata)
    try:
        typed = pj.read_json(
            pa.BufferReader(lines),
            read_options=pj.ReadOptions(use_threads=False, block_size=max(lines.size + 1, 1 << 12)),
            parse_options=pj.ParseOptions(
                explicit_schema=_meta_schema(pa), unexpected_field_behavior="ignore"
            ),
        )
    except pa.ArrowInvalid:
        return None
    if typed.num_rows != n:
        return None
    version, version_max = typed.column("policy_version"), typed.column("policy_version_max")
    if version_max.null_count != n:
        # A version given only as policy_version_max; one given as null stays null, which the
        # reader cannot tell from one not given.
        if pc.any(pc.match_substring(metadata, '"policy_version":null')).as_py():
            return None
        version = pc.coalesce(version, version_max)
    return {
        "reward": typed.column("reward"),
        "advantage": typed.column("advantage"),
        "policy_version": version,
        "stop_reason": typed.column("stop_reason"),
    }


def _empty_rest(pa: Any, n: int) -> dict[str, Any]:
    """Null score, spans and token columns for `n` rows."""
    target = schema()
    return {name: pa.nulls(n, target.field(name).type) for name in ("score", "spans", *TOKEN_FIELDS)}


class _Row(NamedTuple):
    """One journal line's values, each of its column's type."""

    id: str
    step: int
    split: str
    key: str
    time: int
    messages: bytes
    metadata: bytes
    reward: float | None
    advantage: float | None
    version: int | None
    stop: str | None
    score: float | None
    spans: str | None
    tokens: dict[str, bytes | None]


def _row(line: memoryview) -> _Row:
    """A journal line's values; ValueError (or TypeError, KeyError) where it is not a record's."""
    loads, dumps = orjson.loads, orjson.dumps
    data = loads(line)
    rid, step, split, key, when = data["id"], data["step"], data["split"], data["key"], data["timestamp"]
    if type(rid) is not str or type(split) is not str or type(key) is not str:
        raise TypeError("a header field of the wrong type")
    if type(step) is not int or int64_or_none(step) is None:
        raise TypeError("step is not a 64-bit integer")
    if type(when) is not float and type(when) is not int:
        raise TypeError("timestamp is not a number")
    # The column holds 64-bit microseconds: a time past them would fail the whole chunk's column.
    micros = int64_or_none(int(when * 1_000_000))
    if micros is None:
        raise OverflowError("timestamp is out of range")
    sample = data["sample"]
    meta = sample.get("metadata") or {}
    if type(meta) is not dict:
        raise TypeError(f"record {rid!r}: metadata is a {type(meta).__name__}, not an object")
    stop = meta.get("stop_reason")
    spans = sample.get("spans")
    held = sample.get("tokens") or {}
    return _Row(
        rid,
        step,
        split,
        key,
        micros,
        dumps(sample.get("messages", [])),
        dumps(meta),
        _number(meta.get("reward")),
        _number(meta.get("advantage")),
        int64_or_none(meta.get("policy_version", meta.get("policy_version_max"))),
        stop if isinstance(stop, str) else None,
        _number(sample.get("score")),
        dumps(spans).decode() if spans is not None else None,
        {
            name: token_bytes(name, held[name]) if held.get(name) is not None else None
            for name in TOKEN_FIELDS
        },
    )


def _exact_segment(chunk: bytes, skip: Container[str]) -> tuple[Any, int]:
    """The chunk's rows, each payload decoded whole (any layout of the same fields), and how many
    lines were damaged: not JSON, or without a record's fields of their types (left out)."""
    pa = pyarrow()
    view = memoryview(chunk)
    rows: list[_Row] = []
    damaged = 0
    pos, end = 0, len(chunk)
    while pos < end:
        newline = chunk.index(b"\n", pos)
        line = view[pos:newline]
        pos = newline + 1
        try:
            row = _row(line)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
            damaged += 1
            continue
        if row.id not in skip:
            rows.append(row)
    floats, ints, strings = pa.float64(), pa.int64(), pa.string()
    columns = _head_columns(
        pa, [r.id for r in rows], [r.step for r in rows], [r.split for r in rows], [r.key for r in rows],
        [r.time for r in rows],
    )  # fmt: skip
    columns.update(
        messages=_string_column(pa, [r.messages for r in rows]),
        metadata=_string_column(pa, [r.metadata for r in rows]),
        reward=pa.array([r.reward for r in rows], floats),
        advantage=pa.array([r.advantage for r in rows], floats),
        policy_version=pa.array([r.version for r in rows], ints),
        stop_reason=pa.array([r.stop for r in rows], strings),
        score=pa.array([r.score for r in rows], floats),
        spans=pa.array([r.spans for r in rows], strings),
    )
    for name, dtype in TOKEN_FIELDS.items():
        columns[name] = _list_column(pa, dtype, [r.tokens[name] for r in rows])
    return _table(pa, columns), damaged
