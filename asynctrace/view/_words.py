"""When the text index of a Parquet archive (`_text`: the words of each block of each file's
rows) is built: on a thread of its own after the pages are ready, a file at a time (`Index`
reads a file's words, from the cache or from the file)."""

from __future__ import annotations

import os
import threading

import duckdb

from ._store import Store

__all__ = ["TextIndex"]


class TextIndex(Store):
    """A `Store` with table `words` (src, blk, w): a search uses it for the files in
    `text_indexed` and reads every row of the others."""

    def __init__(
        self, source: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(source, cache=cache)
        self._con.execute("CREATE TABLE words (src INTEGER, blk INTEGER, w VARCHAR)")
        self.text_indexed: set[int] = set()
        self._text_lock = threading.Lock()  # guards the indexing thread's state
        self._text_running = threading.Lock()  # one text indexing at a time
        self._text_thread: threading.Thread | None = None
        self._text_again = False  # files came while a text indexing ran: it runs once more

    def _background(self) -> list[threading.Thread]:
        thread = self._text_thread
        return [*super()._background(), *([thread] if thread is not None else [])]

    def index_text_soon(self) -> None:
        """Index the words of the files that have no text index yet, on a thread of its own."""
        with self._text_lock:
            if self._text_thread is not None and self._text_thread.is_alive():
                self._text_again = True
                return
            self._text_again = False
            self._text_thread = threading.Thread(
                target=self._index_text_until_done, name="asynctrace-view-text", daemon=True
            )
            self._text_thread.start()

    def _index_text_until_done(self) -> None:
        while not self.closing.is_set():
            self.index_text()
            with self._text_lock:
                if not self._text_again:
                    self._text_thread = None
                    return
                self._text_again = False

    def text_progress(self) -> tuple[int, int]:
        """(files with a text index, files a search reads) of a Parquet archive; (0, 0) otherwise."""
        if self.kind != "parquet":
            return 0, 0
        with self._lock:
            usable = [src for src, f in enumerate(self.files) if f not in self.skipped]
            return len(self.text_indexed.intersection(usable)), len(usable)

    def index_text(self, *, kept_only: bool = False) -> None:
        """Index the words of every Parquet file that has none yet: read from the sink's sidecar
        or the cache where there, else from the file (and kept). With `kept_only`, only those
        whose words need no message read (seconds at 10M records, where splitting the messages
        takes minutes). It runs through a cursor of its own, so pages are answered meanwhile; a
        file's words are used once all of them are in."""
        if self.kind != "parquet":
            return
        with self._text_running:
            with self._lock:
                todo = [
                    (src, f)
                    for src, f in enumerate(self.files)
                    if src not in self.text_indexed and f not in self.skipped
                ]
            if not todo:
                return
            with self.cursor() as cursor:
                for src, file in todo:
                    if self.closing.is_set():
                        return
                    if kept_only and not self._words_kept(cursor, file):
                        continue
                    try:
                        self._index_words(cursor, src, file)
                    except duckdb.Error:
                        continue  # a file that went away: searched whole, which says it is gone
                    with self._lock:
                        self.text_indexed.add(src)

    def _words_kept(self, con: duckdb.DuckDBPyConnection, file: str) -> bool:
        """Whether a file's words can be read without its messages (`Index` says from where)."""
        raise NotImplementedError

    def _index_words(self, con: duckdb.DuckDBPyConnection, src: int, file: str) -> None:
        """Put one file's words in table `words` (`Index` says from where)."""
        raise NotImplementedError
