"""An archive being indexed on a thread of its own (`Loading`), apart from the web app: the server
starts it before it imports the pages and the app, so that a first open's summary is read while
they load."""

from __future__ import annotations

import functools
import threading
import time

from ._archive import Archive
from ._summary import Summary

__all__ = ["STOP_SECONDS", "Loading"]

# Seconds the server gives the indexing to stop at exit; past them it leaves without Python's
# own ending (which would abort the process with a thread inside DuckDB).
STOP_SECONDS = 10.0


class Loading:
    """An archive being indexed on a thread of its own, so the server answers from its start:
    the overview from the answers a former start kept for the same files (`summary`), if any."""

    def __init__(self, archive: Archive) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.summary: Summary | None = None
        self.archive = archive
        self._thread = threading.Thread(
            target=self._load, args=(archive,), name="asynctrace-view-index", daemon=True
        )
        self._thread.start()

    def _load(self, archive: Archive) -> None:
        try:
            # A later start's kept answers, else on a first open those of the sink's sidecars.
            self.summary = archive.read_summary() or archive.sidecar_summary()
            archive.load(keep=False)
        except BaseException as exc:  # shown on every page: the server stays up to say what failed
            self.error = exc
        finally:
            self.done.set()
        # After the overview is ready: the pages that show token-level values wait for them;
        # the cache saves the next start, not this one; until the text index is in, a search by
        # text reads every message. Each step is skipped once the server stops.
        later_steps = (
            archive.complete_tokens,
            functools.partial(archive.index_text, kept_only=True),  # seconds: before what is longer
            archive.warm_blocks,
            archive.index_ids,
            archive.keep,
            archive.keep_summary,
            archive.index_text,
            archive.index_prompts,  # last: seconds of one core, at the lowest priority
        )
        for later in later_steps:
            if self.error is not None or archive.closing.is_set():
                return
            try:
                later()
            except Exception:  # interrupted at exit, or a cache that could not be kept: the pages go on
                if not archive.closing.is_set():
                    raise

    def stop(self, timeout: float = STOP_SECONDS) -> bool:
        """Interrupt the indexing and wait for it to end (see `Index.shut`): True once nothing
        runs inside DuckDB."""
        return self.archive.shut([self._thread], timeout)
