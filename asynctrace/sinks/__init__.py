"""Sinks: where trace records are written."""

from __future__ import annotations

from ._base import Sink
from ._console import ConsoleSink
from ._jsonl import JsonlSink
from ._trackio import TrackioSink
from ._wandb import WandbSink

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "TrackioSink", "WandbSink"]
