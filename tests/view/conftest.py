"""Archives several view test modules read, each written once per test session (read-only: a
test that changes one copies it first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import _agentic, _hostile


@pytest.fixture(scope="session")
def agentic_archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The agentic run of `_agentic`: (Parquet directory, JSONL file)."""
    return _agentic.write(tmp_path_factory.mktemp("agentic"))


@pytest.fixture(scope="session")
def hostile_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The archive of `_hostile`, a payload in every field."""
    return _hostile.write(tmp_path_factory.mktemp("hostile"))
