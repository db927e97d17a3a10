"""The oldest Trackio `TrackioSink` runs on, and a clear error for an older one or none.

There is no upper bound: what the sink needs of a newer Trackio is detected when its run is
opened (`_trackio_store.find_bulk_log`), and the sink writes through Trackio's public API where
the faster private commit is missing or changed (docs/sinks/trackio.md, "Supported Trackio releases").
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED_TRACKIO", "check_trackio_version"]

# Keep in step with the `trackio` requirement in pyproject.toml: the oldest release tested.
_LOWEST = (0, 41)
SUPPORTED_TRACKIO = f">={_LOWEST[0]}.{_LOWEST[1]}"

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(.*)$")
_PRERELEASE = re.compile(r"^(?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview|dev))", re.IGNORECASE)


def check_trackio_version(version: str | None = None) -> None:
    """Raise ImportError naming the requirement unless `version` (default: the installed
    Trackio's, read without importing it) is at least the lowest supported release."""
    if version is None:
        try:
            version = metadata.version("trackio")
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"TrackioSink needs Trackio, which is not installed: pip install 'trackio{SUPPORTED_TRACKIO}'"
            ) from None
    found = version
    m = _RELEASE.match(found)
    if m is not None:
        major, minor = int(m.group(1)), int(m.group(2))
        # A pre-release of the lowest supported version (0.41.0rc1) comes before it.
        first = (major, minor) == _LOWEST and int(m.group(3) or 0) == 0
        early = first and bool(_PRERELEASE.match(m.group(4)))
        if (major, minor) >= _LOWEST and not early:
            return
    raise ImportError(
        f"TrackioSink needs trackio{SUPPORTED_TRACKIO}; trackio {found!r} is installed. "
        f"Install a supported one: pip install 'trackio{SUPPORTED_TRACKIO}'"
    )
