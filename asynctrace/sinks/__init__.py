"""Sinks: where trace records are written."""

from __future__ import annotations

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
