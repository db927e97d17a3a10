"""The archive-wide by-prompt index the viewer writes beside the sidecars: questions by prompt
answered from it equal those of the files read whole, files it does not cover read from their
own sidecars, and one damaged, foreign or stale ignored and written again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

duckdb = pytest.importorskip("duckdb")
pq = pytest.importorskip("pyarrow.parquet")

from asynctrace.sinks._parquet_sidecar import SIDECAR_FOLDER, sidecar_path  # noqa: E402
from asynctrace.view import _prompt_index  # noqa: E402
from asynctrace.view._archive import Archive  # noqa: E402
from asynctrace.view._held import SidecarsRepaired  # noqa: E402

from ._archive import without_sidecars  # noqa: E402
from .test_sidecar_summary import _damaged_pages, _write_straddling  # noqa: E402

_PROMPTS = [f"p{k}" for k in range(4)] + ["no such prompt", "it's"]
_KEY = b"asynctrace.archive"


def _move(files: list[Path], to: Path) -> None:
    """Move these data files and their sidecars to `to` (and back, `to` their own folder)."""
    for f in files:
        folder = to / SIDECAR_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        for kind in ("index", "byprompt", "words"):
            os.replace(sidecar_path(f, kind), folder / sidecar_path(f, kind).name)
        os.replace(f, to / f.name)


def _opened(directory: Path) -> Archive:
    opened = Archive(directory)
    opened.load(keep=False)
    return opened


def _same_answers(opened: Archive, bare: Archive) -> None:
    for prompt in _PROMPTS:
        assert opened.prompt_history(prompt, "train") == bare.prompt_history(prompt, "train"), prompt
        assert opened.prompt_counts([prompt]) == bare.prompt_counts([prompt])
        assert opened.names(prompt) == bare.names(prompt)


def _archive_with_index(tmp_path: Path) -> tuple[list[Path], Archive]:
    """A run of files with their sidecars and its by-prompt index, and the same files read whole."""
    directory = tmp_path / "run"
    files = _write_straddling(directory, stragglers=True)
    bare = _opened(without_sidecars(directory, tmp_path / "bare"))
    _opened(directory).index_prompts()
    found = _prompt_index.read(duckdb.connect(), directory)
    assert found is not None and [c.name for c in found.covered] == [f.name for f in files]
    return files, bare


def test_questions_by_prompt_from_the_archive_index_equal_the_files_with_files_added_after(
    tmp_path: Path,
) -> None:
    """An index written while a file in the middle and the last were not there: a prompt's
    history, counts and names read it for the files it covers and the others' own by-prompt
    sidecars, and equal those of every row; the next index covers every file."""
    directory = tmp_path / "run"
    files = _write_straddling(directory, stragglers=True)
    bare = _opened(without_sidecars(directory, tmp_path / "bare"))
    later = [files[2], files[-1]]
    _move(later, tmp_path / "aside")
    _opened(directory).index_prompts()
    _move([tmp_path / "aside" / f.name for f in later], directory)
    opened = _opened(directory)
    for prompt in _PROMPTS:
        with opened._lock:
            relation = opened.prompt_relation([prompt])
        assert opened.prompt_index is not None and _prompt_index.PROMPT_INDEX in relation
        named = {f.name for f in files if str(sidecar_path(f, "byprompt")) in relation}
        assert named == {f.name for f in later}, (prompt, sorted(named))
    _same_answers(opened, bare)
    opened.index_prompts()
    _same_answers(opened, bare)
    assert opened.prompt_index is not None and len(opened.prompt_index.covered) == len(files)


def _rewritten(path: Path, note: Any = None, table: Any = None) -> None:
    """The index written again with this note (as data) or table, the rest kept."""
    old = pq.read_table(path)
    table = old if table is None else table
    metadata = dict(old.schema.metadata)
    if note is not None:
        metadata[_KEY] = orjson.dumps(note)
    pq.write_table(table.replace_schema_metadata(metadata), path)


def _note(path: Path) -> dict[str, Any]:
    found: dict[str, Any] = orjson.loads(pq.read_schema(path).metadata[_KEY])
    return found


def _garbage(path: Path) -> None:
    path.write_bytes(b"PAR1 not a parquet file PAR1")


def _a_link(path: Path) -> None:
    """A link to a valid index elsewhere."""
    elsewhere = path.parent.parent.parent / "elsewhere.parquet"
    shutil.copyfile(path, elsewhere)
    path.unlink()
    path.symlink_to(elsewhere)


def _retyped(path: Path) -> None:
    table = pq.read_table(path)
    _rewritten(path, table=table.set_column(2, "step", table.column(2).cast("float64")))


def _other_version(path: Path) -> None:
    _rewritten(path, {**_note(path), "version": 2})


def _a_path_named(path: Path) -> None:
    """A covered file named by a path out of the folder."""
    note = _note(path)
    note["files"][0]["name"] = "../run/" + note["files"][0]["name"]
    _rewritten(path, note)


def _stale_size(path: Path) -> None:
    """A covered file of another size than the file of that name now."""
    note = _note(path)
    note["files"][1]["size"] += 1
    _rewritten(path, note)


def _rows_of_another_file(path: Path) -> None:
    """Its files' rows swapped: the sum is right, each file's count not."""
    note = _note(path)
    first, second = note["files"][0], note["files"][1]
    assert first["rows"] != second["rows"] or note["files"][-1]["rows"] != first["rows"]
    other = second if first["rows"] != second["rows"] else note["files"][-1]
    first["rows"], other["rows"] = other["rows"], first["rows"]
    _rewritten(path, note)


def _covered_gone(path: Path) -> None:
    """A file it covers is no longer in the archive."""
    note = _note(path)
    note["files"].append({"name": "gone.parquet", "size": 10, "rows": 0})
    _rewritten(path, note)


def _note_not_a_list(path: Path) -> None:
    _rewritten(path, {"version": 1, "files": {"name": "x"}})


@pytest.mark.parametrize(
    "spoil",
    [
        _garbage,
        _a_link,
        _retyped,
        _other_version,
        _a_path_named,
        _stale_size,
        _rows_of_another_file,
        _covered_gone,
        _note_not_a_list,
    ],
)
def test_a_damaged_foreign_or_stale_archive_index_is_ignored_and_written_again(
    spoil: Any, tmp_path: Path
) -> None:
    """What fails a check is not read: the files' own by-prompt sidecars answer, as the files
    read whole do, and the next index written is valid and covers every file."""
    files, bare = _archive_with_index(tmp_path)
    directory = files[0].parent
    spoil(_prompt_index.path_of(directory))
    opened = _opened(directory)
    with opened._lock:
        relation = opened.prompt_relation(["p1"])
    assert opened.prompt_index is None and _prompt_index.PROMPT_INDEX not in relation
    _same_answers(opened, bare)
    opened.index_prompts()
    found = _prompt_index.read(duckdb.connect(), directory)
    assert found is not None and len(found.covered) == len(files)
    assert not _prompt_index.path_of(directory).is_symlink()
    _same_answers(opened, bare)
    assert opened.prompt_index is not None


def test_an_archive_index_damaged_past_its_footer_is_dropped_at_the_first_failed_query(
    tmp_path: Path,
) -> None:
    """Its footer passes, its pages do not: the first question by prompt fails and says that
    asked again it is answered, then from the files' own sidecars; it is removed, and the next
    one written is read."""
    files, bare = _archive_with_index(tmp_path)
    directory = files[0].parent
    _damaged_pages(_prompt_index.path_of(directory))
    opened = _opened(directory)
    with pytest.raises(SidecarsRepaired):
        opened.prompt_history("p1", "train")
    assert opened.prompt_index is None and not _prompt_index.path_of(directory).exists()
    _same_answers(opened, bare)
    opened.index_prompts()
    assert _prompt_index.read(duckdb.connect(), directory) is not None
    _same_answers(opened, bare)
    assert opened.prompt_index is not None


def test_a_killed_builder_s_temporary_is_removed_and_a_live_one_s_kept(tmp_path: Path) -> None:
    """A temporary of the builder's pattern whose process is gone (SIGKILL) is removed before
    the next index is written; that of a process still running is its work in progress."""
    directory = tmp_path / "run"
    _write_straddling(directory)
    sleeping = [sys.executable, "-c", "import time; time.sleep(60)"]
    killed, alive = subprocess.Popen(sleeping), subprocess.Popen(sleeping)
    try:
        folder = directory / SIDECAR_FOLDER
        dead = folder / f".archive.byprompt.parquet.{killed.pid}.tmp"
        live = folder / f".archive.byprompt.parquet.{alive.pid}.tmp"
        dead.write_bytes(b"half an index")
        live.write_bytes(b"an index being written")
        killed.kill()
        killed.wait()
        _opened(directory).index_prompts()
        assert not dead.exists() and live.exists()
        assert _prompt_index.read(duckdb.connect(), directory) is not None
    finally:
        alive.kill()
        alive.wait()


_CANNOT_WRITE = """
import resource, signal, sys
from pathlib import Path
from asynctrace.view import _prompt_index
from asynctrace.view._archive import Archive
directory = Path(sys.argv[1])
opened = Archive(directory)
opened.load(keep=False)
before = opened.prompt_history(sys.argv[2], "train")
# No byte can be written from here on (as on a full disk; the read-only folder stops a user who
# is not root, and root only by this).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
opened.index_prompts()
assert not _prompt_index.path_of(directory).exists() and opened.prompt_index is None
assert opened.prompt_history(sys.argv[2], "train") == before
print("no index")
"""


def test_a_folder_the_viewer_cannot_write_keeps_no_index(tmp_path: Path) -> None:
    """A shared archive the viewer cannot write in (read-only to it, or a full disk): no index, no
    error, no temporary left, the pages as before."""
    directory = tmp_path / "run"
    _write_straddling(directory)
    folder = directory / SIDECAR_FOLDER
    folder.chmod(0o555)
    try:
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=str(root))
        child = subprocess.run(
            [sys.executable, "-c", _CANNOT_WRITE, str(directory), _PROMPTS[0]],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        folder.chmod(0o755)
    assert child.returncode == 0 and child.stdout == "no index\n", child.stderr[-2000:]
    assert not list(folder.glob(".*.tmp"))


def test_the_server_s_indexing_writes_the_archive_index_after_a_first_open(tmp_path: Path) -> None:
    """The indexing thread a server starts (`Loading`) writes the index last, and a question by
    prompt then reads it, answering as the files read whole do."""
    import time

    from asynctrace.view._loading import Loading

    directory = tmp_path / "run"
    _write_straddling(directory)
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.load()
    archive = Archive(directory)
    loading = Loading(archive)
    try:
        deadline = time.monotonic() + 60
        while _prompt_index.read(duckdb.connect(), directory) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _prompt_index.read(duckdb.connect(), directory) is not None
        assert loading.done.is_set() and loading.error is None
        time.sleep(0.5)  # the thread takes it up at the next question by prompt
        _same_answers(archive, bare)
        assert archive.prompt_index is not None
    finally:
        assert loading.stop()
