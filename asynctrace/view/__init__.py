"""`asynctrace view`: a local web page over a run's archive (Parquet, or JSONL), read with DuckDB.

Needs the ``view`` extra (``pip install "asynctrace[view]"``): DuckDB, Starlette and uvicorn are
imported only when a viewer is made, never by ``import asynctrace``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "make_app", "require", "serve"]

_NEEDED = ("duckdb", "starlette", "uvicorn")


def require() -> None:
    """Raise an `ImportError` naming the extra when a package the viewer needs is missing."""
    import importlib.util

    missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f'asynctrace view needs {", ".join(missing)}: pip install "asynctrace[view]"')


def cache_dir() -> Path:
    """Where the command keeps each Parquet file's index: $ASYNCTRACE_VIEW_CACHE, else
    $XDG_CACHE_HOME/asynctrace/view, else ~/.cache/asynctrace/view."""
    explicit = os.environ.get("ASYNCTRACE_VIEW_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asynctrace" / "view"


def make_app(
    source: str | os.PathLike[str],
    *,
    watch: Sequence[str] = (),
    cache: str | os.PathLike[str] | None = None,
    hosts: Sequence[str] = (),
) -> Any:
    """The viewer's ASGI app (Starlette) over the archive at `source` (a Parquet directory or
    JSONL), indexed before this returns; `cache` keeps each Parquet file's index for the next start.
    It answers only requests addressed to 127.0.0.1, localhost, [::1] or one of `hosts` (any
    port), and refuses others with 421."""
    require()
    from ._app import build_app
    from ._archive import Archive
    from ._guard import LOOPBACK, host_names

    archive = Archive(source, cache=cache)
    archive.load()
    return build_app(archive, watch=watch, hosts={*LOOPBACK}.union(*(host_names(h) for h in hosts)))


def serve(
    source: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8321,
    watch: Sequence[str] = (),
    cache: str | os.PathLike[str] | None = None,
    ready: Any = None,
) -> None:
    """Serve the viewer on `host`:`port` until interrupted; `ready(url)` is called once it listens
    (it indexes the archive meanwhile, and says so on every page until it is done)."""
    require()
    from ._server import run

    run(source, host=host, port=port, watch=watch, cache=cache, ready=ready)
