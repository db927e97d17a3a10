"""asynctrace: log RL rollout traces from asynchronous trainers without slowing them down."""

from __future__ import annotations

from . import testing
from ._engine.retry import RetryPolicy
from ._records.types import Sample, TraceRecord
from ._select.base import Sampler, StepSelection
from ._select.groups import GroupSampler
from ._select.samplers import FirstSampler, ReservoirSampler, TopBottomSampler
from ._select.watch import Watch
from ._session import TraceSession, install_shutdown_hooks
from ._stats import SessionStats, SinkStats, SpoolStats
from ._sync import SyncTraceSession
from .exceptions import AsyncTraceError, PermanentSinkError, RecordError, SessionClosedError, SpoolError
from .sinks import (
    ConsoleSink,
    JsonlSink,
    MlflowSink,
    ParquetSink,
    Selected,
    Sink,
    TrackioSink,
    WandbSink,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncTraceError",
    "ConsoleSink",
    "FirstSampler",
    "GroupSampler",
    "JsonlSink",
    "MlflowSink",
    "ParquetSink",
    "PermanentSinkError",
    "RecordError",
    "ReservoirSampler",
    "RetryPolicy",
    "Sample",
    "Sampler",
    "Selected",
    "SessionClosedError",
    "SessionStats",
    "Sink",
    "SinkStats",
    "SpoolError",
    "SpoolStats",
    "StepSelection",
    "SyncTraceSession",
    "TopBottomSampler",
    "Watch",
    "TraceRecord",
    "TraceSession",
    "TrackioSink",
    "WandbSink",
    "__version__",
    "install_shutdown_hooks",
    "testing",
]
