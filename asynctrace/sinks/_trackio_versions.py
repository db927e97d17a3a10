"""Which Trackio releases `TrackioSink` supports, and a clear error for any other.

The sink commits through Trackio's storage class, which is not a public API, so only the releases
it was tested with are supported (docs/sinks.md, "Supported Trackio releases").
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED_TRACKIO", "check_trackio_version"]

# Keep in step with the `trackio` requirement in pyproject.toml.
_LOWEST = (0, 41)
_BEYOND = (0, 44)
SUPPORTED_TRACKIO = f">={_LOWEST[0]}.{_LOWEST[1]},<{_BEYOND[0]}.{_BEYOND[1]}"

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(.*)$")
_PRERELEASE = re.compile(r"^(?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview|dev))", re.IGNORECASE)


def check_trackio_version(version: str | None = None) -> None:
    """Raise ImportError naming the supported range unless `version` (default: the installed
    Trackio's, read without importing it) is within it."""
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
        if _LOWEST <= (major, minor) < _BEYOND and not early:
            return
    raise ImportError(
        f"TrackioSink supports trackio{SUPPORTED_TRACKIO}, the releases it is tested with; "
        f"trackio {found!r} is installed. Install a supported one: pip install 'trackio{SUPPORTED_TRACKIO}'"
    )
