"""W&B acknowledgements that fail safe: the `.wandb` reader fed what it cannot read (another
format, damaged, truncated, an unknown chunk, a wandb without its `Record` type) counts nothing
from it, and a `WandbSink` whose run's log it cannot read counts no row written, says so once,
reports itself degraded (`stats()`, the health metrics) and hands W&B no more rows."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import anyio
import pytest

import asynctrace as at
from asynctrace.exceptions import PermanentSinkError
from asynctrace.sinks._guard import Serial
from asynctrace.sinks._wandb_ack import Book, table_file
from asynctrace.sinks._wandb_txlog import LogTail
from tests._util import sample
from tests.sinks._wandb_env import SETTINGS, offline_wandb, trainer_run
from tests.sinks._wandb_log import frame, history, records, table_rows

__all__ = ["offline_wandb"]

KEY = "train/traces-incr"
# The header of the `.wandb` format wandb 0.31 writes: ident, magic number, version 0.
FORMAT = b":W&B\xe1\xbe\x00"


class RealLog(NamedTuple):
    """A finished offline run's `.wandb` file and the table files of its increments of `KEY`
    (as found in its folder, and as each `wandb.Table` named it after its log)."""

    path: Path
    files: list[str]
    records: list[bytes]
    named: list[str | None]


@pytest.fixture(scope="module")
def real_log(offline_wandb: Path) -> RealLog:
    """Two increments of an incremental table logged by a real W&B run, which it finished."""
    import wandb

    run = wandb.init(project="p", name="real", dir=str(offline_wandb), settings=wandb.Settings(**SETTINGS))  # type: ignore[arg-type]
    table = wandb.Table(columns=["id"], log_mode="INCREMENTAL")
    files_dir = Path(run.dir)
    named = []
    for step in range(2):
        table.add_data(f"row-{step}")
        run.log({KEY: table, "trainer/loss": float(step)})
        named.append(table_file(table, files_dir, KEY))
    run.finish()
    files = sorted(
        p.relative_to(files_dir).as_posix() for p in files_dir.glob("media/table/train/*.table.json")
    )
    assert len(files) == 2
    path = Path(run.settings.sync_file)
    history(path.parent)  # waits for the run's exit record: wandb-core writes it after finish()
    return RealLog(path, files, records(path), named)


def _read(path: Path, polls: int = 2) -> LogTail:
    tail = LogTail(path)
    for _ in range(polls):
        tail.poll()
    return tail


def _holding(log: RealLog, text: str) -> int:
    """The index of the first record of `log` whose bytes hold `text`."""
    return next(i for i, raw in enumerate(log.records) if text.encode() in raw)


def test_the_reader_reads_a_real_log(real_log: RealLog) -> None:
    """An intact `.wandb` file of the wandb installed: every increment found, the run's end too."""
    tail = _read(real_log.path)
    assert tail.broken is None and tail.finished
    assert set(real_log.files) <= tail.files and tail.reached[KEY] == 2
    # The same records framed by the tests' own writer read the same.
    copy = real_log.path.with_name("copy.wandb")
    copy.write_bytes(frame(real_log.records))
    assert _read(copy).files == tail.files


def test_each_increments_file_is_the_one_its_history_record_names(real_log: RealLog, tmp_path: Path) -> None:
    """After `run.log`, a table names the file W&B stored the increment in, as the increment's
    history record does (no listing of the run's table folder needed); a table not logged, or
    one whose file is not of the key, names none."""
    import wandb

    assert real_log.named == real_log.files
    assert set(real_log.files) <= _read(real_log.path).files
    assert table_file(wandb.Table(columns=["id"]), tmp_path, KEY) is None
    assert table_file(wandb.Table(columns=["id"]), tmp_path, "other-incr") is None


def test_a_log_whose_file_is_not_known_is_confirmed_by_no_other_increment(real_log: RealLog) -> None:
    """The key's increments in the `.wandb` file (an earlier session's, another sink's) never
    stand in for a log of the sink's whose table file is not known."""
    tail = _read(real_log.path)
    book = Book()
    unknown = book.add(KEY, ["a"])
    assert tail.reached[KEY] == 2 and unknown.file is None and not book.in_log(tail, KEY, 1)
    book.add(KEY, ["b"]).file = real_log.files[1]
    assert book.in_log(tail, KEY, 2)


def _history_record(step: int, file: str | None = None, filler: int = 0) -> bytes:
    """A history record of W&B step `step` naming `file` as an increment of `KEY`, or holding
    `filler` bytes of another key."""
    from wandb.proto import wandb_internal_pb2 as pb

    if file is not None:
        item = pb.HistoryItem(nested_key=[KEY, "path"], value_json=f'"{file}"')  # type: ignore[attr-defined]
    else:
        item = pb.HistoryItem(nested_key=["trainer", "text"], value_json='"' + "x" * filler + '"')  # type: ignore[attr-defined]
    return pb.Record(history=pb.HistoryRecord(item=[item], step=pb.HistoryStep(num=step))).SerializeToString()  # type: ignore[attr-defined, no-any-return]


def test_an_existing_log_is_read_from_near_its_end(tmp_path: Path) -> None:
    """A log 4 MB long at the first poll is read from a block boundary near its end, the rest of
    the record begun before it skipped: the increment named there counts, the one at its start
    is never read. What is appended later counts, each poll reading a bounded part of it."""
    block = 32768
    early, late, after = (f"media/table/train/traces-incr_{i}_x.table.json" for i in range(3))
    fillers = [_history_record(step, filler=40_000) for step in range(1, 101)]
    items: list[bytes | tuple[int, bytes]] = [_history_record(0, early), *fillers, _history_record(101, late)]
    path = tmp_path / "long.wandb"
    path.write_bytes(data := frame(items))
    # Every block of the fillers begins inside a record (a middle or last piece of one).
    assert {data[at_ + 6] for at_ in range(block, len(data) - block, block)} <= {3, 4}
    tail = LogTail(path)
    assert tail.poll() is True
    assert tail.broken is None and late in tail.files and early not in tail.files
    assert tail.last_step == 101
    more = [_history_record(step, filler=40_000) for step in range(102, 402)]  # 12 MB more
    path.write_bytes(frame([*items, *more, _history_record(402, after)]))
    assert tail.poll() is False and after not in tail.files  # read in part: more is there
    polls = 1
    while not tail.poll():
        polls += 1
        assert polls < 10
    assert tail.broken is None and after in tail.files and tail.last_step == 402


def _damaged_history(log: RealLog, file: str) -> bytes:
    """The bytes of `log` with one digit changed in the history record that names `file` (its
    `_runtime`): still a valid record, which the chunk's checksum alone tells apart."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = bytearray(log.path.read_bytes())
    for raw in log.records:
        record = pb.Record.FromString(raw)  # type: ignore[attr-defined]
        items = record.history.item
        if record.WhichOneof("record_type") == "history" and any(i.value_json == f'"{file}"' for i in items):
            (runtime,) = [
                i.value_json for i in items if [*i.nested_key] == ["_runtime"] or i.key == "_runtime"
            ]
            at_ = data.index(raw) + raw.index(runtime.encode()) + len(runtime) - 1
            data[at_] = ord("0") + (data[at_] - ord("0") + 1) % 10
            return bytes(data)
    raise AssertionError(f"no history record names {file}")


def test_a_damaged_chunk_counts_nothing_from_it_on(real_log: RealLog, tmp_path: Path) -> None:
    """A digit changed in the history record of the second increment: the record still decodes,
    but its chunk's checksum fails twice (once could be a read racing wandb-core's write), so the
    reader stops, and neither that increment nor anything after it counts; the first still does."""
    damaged = tmp_path / "damaged.wandb"
    damaged.write_bytes(_damaged_history(real_log, real_log.files[1]))
    once = _read(damaged, polls=1)
    assert real_log.files[1] not in once.files and real_log.files[0] in once.files
    assert once.broken is None
    tail = _read(damaged)
    assert real_log.files[1] not in tail.files and not tail.finished
    assert tail.broken is not None and "checksum" in tail.broken, tail.broken


@pytest.mark.parametrize(
    "header",
    [FORMAT[:6] + b"\x01", b":W&B" + FORMAT[4:6][::-1] + b"\x00", b"LevelDB"],
    ids=["next-version", "other-magic", "not-wandb"],
)
def test_another_format_counts_nothing(real_log: RealLog, tmp_path: Path, header: bytes) -> None:
    """A file whose header is not that of the format the reader knows: nothing of it counts."""
    other = tmp_path / "other.wandb"
    other.write_bytes(frame(real_log.records, header=header))
    tail = _read(other)
    assert not tail.files and not tail.reached and not tail.finished
    assert tail.broken is not None and "header" in tail.broken


@pytest.mark.parametrize("kind", [0, 5, 255], ids=["zero", "five", "ff"])
def test_an_unknown_chunk_kind_counts_nothing_from_it_on(
    real_log: RealLog, tmp_path: Path, kind: int
) -> None:
    """A chunk of a kind a LevelDB log does not have, checksum right, before the increments."""
    at_ = _holding(real_log, real_log.files[0])
    items: list[bytes | tuple[int, bytes]] = [*real_log.records]
    items.insert(at_, (kind, b"\x08\x01"))
    odd = tmp_path / "odd.wandb"
    odd.write_bytes(frame(items))
    tail = _read(odd)
    assert not tail.files
    assert tail.broken is not None and f"kind {kind}" in tail.broken, tail.broken


def test_a_record_that_is_not_wandbs_counts_nothing_from_it_on(real_log: RealLog, tmp_path: Path) -> None:
    """A whole chunk, checksum right, whose bytes do not decode as wandb's `Record`."""
    items: list[bytes | tuple[int, bytes]] = [*real_log.records]
    items.insert(_holding(real_log, real_log.files[0]), b"\xff\xff\xff\xff")
    odd = tmp_path / "odd.wandb"
    odd.write_bytes(frame(items))
    tail = _read(odd)
    assert not tail.files
    assert tail.broken is not None and "Record" in tail.broken, tail.broken


def test_a_record_kind_of_a_later_wandb_is_skipped(real_log: RealLog, tmp_path: Path) -> None:
    """A `Record` of a kind this wandb does not know (a field number it has not got), as a later
    wandb may write: skipped, and the increments after it count."""
    unknown = b"\xf8\xff\x3f\x01"  # field 1048575, varint 1
    newer = tmp_path / "newer.wandb"
    newer.write_bytes(frame([unknown, *real_log.records]))
    tail = _read(newer)
    assert tail.broken is None and set(real_log.files) <= tail.files


def test_a_truncated_file_counts_nothing_it_lost(real_log: RealLog, tmp_path: Path) -> None:
    """A file cut inside the second increment's record is waited on (wandb-core may be writing
    it), never counted; a file cut shorter than what was read from it stops the reader."""
    data = real_log.path.read_bytes()
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(data[: data.index(real_log.files[1].encode())])
    tail = _read(cut)
    assert tail.broken is None and real_log.files[0] in tail.files and real_log.files[1] not in tail.files
    cut.write_bytes(data[:100])
    tail.poll()
    assert tail.broken is not None and "shrank" in tail.broken, tail.broken
    cut.unlink()
    assert _read(cut).broken is None  # a file not there yet: nothing read, nothing wrong


@pytest.mark.parametrize(
    "stand_in",
    [
        # A wandb package with no `proto` subpackage.
        "sys.modules['wandb'] = types.ModuleType('wandb')",
        # A wandb whose protocol module has no `Record`.
        "for name in ('wandb', 'wandb.proto', 'wandb.proto.wandb_internal_pb2'):\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "sys.modules['wandb'].proto = sys.modules['wandb.proto']\n"
        "sys.modules['wandb.proto'].wandb_internal_pb2 = sys.modules['wandb.proto.wandb_internal_pb2']",
    ],
    ids=["no-wandb-proto", "no-Record"],
)
def test_a_wandb_without_its_record_type_counts_nothing(real_log: RealLog, stand_in: str) -> None:
    """A wandb whose `wandb.proto.wandb_internal_pb2` cannot be imported, or has no `Record`: the
    reader says so and counts nothing (in a process of its own, such a wandb standing in)."""
    code = (
        "import sys, types\n"
        + stand_in
        + textwrap.dedent(
            """
        from pathlib import Path
        from asynctrace.sinks._wandb_txlog import LogTail
        tail = LogTail(Path(sys.argv[1]))
        tail.poll()
        print(tail.broken)
        print(len(tail.files), tail.finished)
        """
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(real_log.path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    broken, counted = done.stdout.splitlines()
    assert "Record type cannot be loaded" in broken and counted == "0 False"


@pytest.mark.anyio
async def test_a_log_past_the_rows_step_without_them_fails_them(tmp_path: Path) -> None:
    """A log that holds a later W&B step than the one the rows joined, and no record of them (a
    format whose table records the reader does not recognise): the rows fail and the sink is
    degraded, never waiting for them for good; while the log has not reached their step, they wait."""
    from wandb.proto import wandb_internal_pb2 as pb

    from asynctrace.sinks._wandb_ack import Acks

    def history(step: int) -> bytes:
        item = pb.HistoryItem(nested_key=["other-incr", "path"], value_json='"media/table/other.json"')  # type: ignore[attr-defined]
        return pb.Record(
            history=pb.HistoryRecord(item=[item], step=pb.HistoryStep(num=step))
        ).SerializeToString()  # type: ignore[attr-defined]

    path = tmp_path / "run.wandb"
    path.write_bytes(frame([history(3)]))
    acks = Acks(Serial("test", lambda exc: None), lambda: None, lambda: True)
    acks.tail = LogTail(path)
    log = acks.book.add(KEY, ["r"])
    log.file, log.step = "media/table/train/traces-incr_0_x.table.json", 4
    record = at.TraceRecord("r", 0, "train", "train/traces", b"{}", 0.0)
    with anyio.move_on_after(0.5) as waited:
        await acks.persisted([record])
    assert waited.cancelled_caught and acks.unreadable is None  # step 3 of 4: still to come
    path.write_bytes(frame([history(3), history(5)]))
    with pytest.raises(PermanentSinkError, match="cannot be read"):
        await acks.persisted([record])
    assert acks.unreadable is not None and "step 5" in acks.unreadable


@pytest.mark.anyio
async def test_a_sink_that_cannot_read_its_log_counts_no_row_written(
    offline_wandb: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An attached run whose `.wandb` file is damaged: the rows W&B wrote (the trainer moved on)
    count as failed, not written, with the reason; one warning; `stats()` and the health metrics
    say the sink is degraded; later rows are not handed to W&B at all."""
    run = await trainer_run(offline_wandb, "damaged")
    log = Path(run.settings.sync_file)
    try:
        await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 0.0}))
        with anyio.fail_after(30):
            while log.stat().st_size <= len(FORMAT) + 64:
                await anyio.sleep(0.01)
        with log.open("r+b") as f:  # one byte of the first record (W&B's own header record)
            f.seek(len(FORMAT) + 10)
            byte = f.read(1)
            f.seek(len(FORMAT) + 10)
            f.write(bytes([byte[0] ^ 0x01]))
        memory = at.testing.MemorySink("memory")
        s = at.TraceSession(
            "p", run="damaged", sinks=[at.WandbSink(attach=run), memory], health_interval=0.05
        )
        with caplog.at_level(logging.WARNING, logger="asynctrace"):
            async with s:
                await s.log_samples([sample(i) for i in range(5)], step=0)
                assert await s.flush(timeout=10)
                await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 1.0}))
                with anyio.fail_after(30):  # W&B writes them now: resolved, one way or the other
                    while (done := s.stats().sinks["wandb"]).written + done.failed < 5:
                        await anyio.sleep(0.01)
                assert (done.written, done.failed) == (0, 5), done
                await s.log_samples([sample(i) for i in range(5, 10)], step=1)
                await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 2.0}))
                await s.flush(timeout=10)
        stats = s.stats()
    finally:
        await anyio.to_thread.run_sync(run.finish)
    wandb = stats.sinks["wandb"]
    assert (wandb.written, wandb.failed) == (0, 10) and stats.check(), stats.summary()
    assert wandb.degraded is not None and "checksum" in wandb.degraded
    assert "transaction log cannot be read" in str(wandb.last_error)
    warnings = [r for r in caplog.records if "cannot read W&B's .wandb transaction log" in r.getMessage()]
    assert len(warnings) == 1
    assert memory.metrics[-1][1]["asynctrace/sinks/wandb/degraded"] == 1.0
    # The first rows were handed over before the damage was found (and W&B has them); the
    # later ones never were.
    assert len(table_rows(Path(run.dir), KEY)) == 5
