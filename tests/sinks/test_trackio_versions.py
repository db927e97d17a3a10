"""TrackioSink refuses a Trackio outside the releases it is tested with, naming the range."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

import asynctrace as at
from asynctrace.exceptions import PermanentSinkError
from asynctrace.sinks._trackio_versions import SUPPORTED_TRACKIO, check_trackio_version
from asynctrace.sinks._trackio_writer import TrackioWriter

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version", ["0.41.0", "0.41.3", "0.42.0", "0.43.0", "0.43.7", "0.43.0.dev1", "0.43.1rc1"]
)
def test_supported_versions_pass(version: str) -> None:
    """Every release of the supported minor versions passes, pre-releases of a later patch too."""
    check_trackio_version(version)


@pytest.mark.parametrize(
    "version", ["0.40.2", "0.41.0rc1", "0.44.0", "0.44.0rc1", "1.0.0", "0.9", "", "latest"]
)
def test_other_versions_are_refused_naming_the_range(version: str) -> None:
    """An older, newer or unreadable version gets an ImportError that names the range and the fix."""
    with pytest.raises(ImportError) as info:
        check_trackio_version(version)
    message = str(info.value)
    assert f"trackio{SUPPORTED_TRACKIO}" in message and repr(version) in message
    assert f"pip install 'trackio{SUPPORTED_TRACKIO}'" in message


def test_the_installed_trackio_is_supported() -> None:
    """The Trackio this suite runs against is inside the range (so the suite tests the range)."""
    check_trackio_version()
    check_trackio_version(metadata.version("trackio"))


def test_the_range_is_the_one_pyproject_requires() -> None:
    """The package's requirement and the sink's check name the same releases."""
    found = re.findall(r'^\s*"(trackio[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert [r.replace(" ", "") for r in found] == [f"trackio{SUPPORTED_TRACKIO}"]


def test_sink_refuses_an_unsupported_installed_trackio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a TrackioSink (and so a default session) fails at once, before any record is taken."""
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.44.0" if name == "trackio" else real(name))
    with pytest.raises(ImportError, match=re.escape(f"trackio{SUPPORTED_TRACKIO}")):
        at.TrackioSink()
    with pytest.raises(ImportError, match=re.escape("'0.44.0' is installed")):
        at.TraceSession("p", run="r")


def test_sink_names_a_missing_trackio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Trackio installed, the error says to install it, with the range."""
    real = metadata.version

    def version(name: str) -> str:
        if name == "trackio":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    expected = f"not installed: pip install 'trackio{SUPPORTED_TRACKIO}'"
    with pytest.raises(ImportError, match=re.escape(expected)):
        at.TrackioSink()


def test_writer_refuses_the_trackio_it_imported(project: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer checks the Trackio it imports too, and fails permanently (no retry can help)."""
    import trackio

    monkeypatch.setattr(trackio, "__version__", "0.40.0")
    with pytest.raises(PermanentSinkError, match=re.escape(SUPPORTED_TRACKIO)):
        TrackioWriter(project, "r").open()
