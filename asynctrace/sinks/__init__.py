"""Sinks: where trace records are written."""

from __future__ import annotations

from ._base import Sink
from ._console import ConsoleSink
from ._jsonl import JsonlSink
from ._selected import Selected
from ._trackio import TrackioSink

__all__ = ["ConsoleSink", "JsonlSink", "Selected", "Sink", "TrackioSink"]
