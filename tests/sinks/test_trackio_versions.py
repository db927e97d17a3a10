"""TrackioSink refuses a Trackio older than it supports, naming the requirement, and nothing newer:
neither its check nor the package's metadata holds back a Trackio upgrade."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import asynctrace as at
from asynctrace.exceptions import PermanentSinkError
from asynctrace.sinks._trackio_versions import SUPPORTED_TRACKIO, check_trackio_version
from asynctrace.sinks._trackio_writer import TrackioWriter

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version",
    [
        "0.41.0",
        "0.41.3",
        "0.42.0",
        "0.43.0",
        "0.43.7",
        "0.43.0.dev1",
        "0.44.0",
        "0.44.0rc1",
        "0.51.2",
        "1.0.0",
    ],
)
def test_supported_versions_pass(version: str) -> None:
    """Every release from the lowest supported one on passes, later ones and their pre-releases too."""
    check_trackio_version(version)


@pytest.mark.parametrize("version", ["0.40.2", "0.41.0rc1", "0.9", "", "latest"])
def test_older_or_unreadable_versions_are_refused_naming_the_requirement(version: str) -> None:
    """An older or unreadable version gets an ImportError that names the requirement and the fix."""
    with pytest.raises(ImportError) as info:
        check_trackio_version(version)
    message = str(info.value)
    assert f"trackio{SUPPORTED_TRACKIO}" in message and repr(version) in message
    assert f"pip install 'trackio{SUPPORTED_TRACKIO}'" in message


def test_the_installed_trackio_is_supported() -> None:
    """The Trackio this suite runs against is inside the range (so the suite tests the range)."""
    check_trackio_version()
    check_trackio_version(metadata.version("trackio"))


def _trackio_requirements() -> list[Requirement]:
    """Every requirement on trackio in pyproject.toml, the extras' included."""
    text = (ROOT / "pyproject.toml").read_text()
    return [Requirement(r) for r in re.findall(r'"(trackio\b[^"]*)"', text)]


def test_the_requirement_is_the_one_pyproject_declares_and_admits_later_releases() -> None:
    """The package requires what the sink checks, with no upper bound: installing a later Trackio
    beside asynctrace (0.44 and on) is not refused by its metadata."""
    found = _trackio_requirements()
    assert [str(r.specifier) for r in found] == [SUPPORTED_TRACKIO]
    for later in ("0.43.0", "0.44.0", "0.44.1", "0.60.0", "1.0.0", "2.3.4"):
        assert found[0].specifier.contains(later), later
    assert not found[0].specifier.contains("0.40.9")


def test_sink_refuses_an_older_installed_trackio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a TrackioSink (and so a default session) fails at once, before any record is taken,
    where an older Trackio is installed; a later one is accepted."""
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.40.0" if name == "trackio" else real(name))
    with pytest.raises(ImportError, match=re.escape(f"trackio{SUPPORTED_TRACKIO}")):
        at.TrackioSink()
    with pytest.raises(ImportError, match=re.escape("'0.40.0' is installed")):
        at.TraceSession("p", run="r")
    monkeypatch.setattr(metadata, "version", lambda name: "0.44.0" if name == "trackio" else real(name))
    at.TrackioSink()


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
