"""Sinks: where trace records are written."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._base import Sink
    from ._console import ConsoleSink
    from ._jsonl import JsonlSink
    from ._mlflow import MlflowSink
    from ._parquet import ParquetSink
    from ._selected import Selected
    from ._trackio import TrackioSink
    from ._wandb import WandbSink

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MlflowSink",
    "ParquetSink",
    "Selected",
    "Sink",
    "TrackioSink",
    "WandbSink",
]

# Each sink and the module that defines it, imported on first use: a process that needs one
# sink's module (the viewer reads the Parquet sidecars' names) does not load every other's.
_HOME = {
    "ConsoleSink": "._console",
    "JsonlSink": "._jsonl",
    "MlflowSink": "._mlflow",
    "ParquetSink": "._parquet",
    "Selected": "._selected",
    "Sink": "._base",
    "TrackioSink": "._trackio",
    "WandbSink": "._wandb",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'asynctrace.sinks' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
