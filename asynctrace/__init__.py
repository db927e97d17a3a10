"""asynctrace: log RL rollout traces from asynchronous trainers without slowing them down."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import testing
    from ._engine.retry import RetryPolicy
    from ._records.types import Sample, TraceRecord
    from ._recover import recover
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

# Each public name and the module that defines it, imported on first use: `import asynctrace`
# stays cheap for the command line (`asynctrace view`, `recover`) and for processes that only
# pass a session's settings around.
_HOME = {
    "RetryPolicy": "._engine.retry",
    "recover": "._recover",
    "Sample": "._records.types",
    "TraceRecord": "._records.types",
    "Sampler": "._select.base",
    "StepSelection": "._select.base",
    "GroupSampler": "._select.groups",
    "FirstSampler": "._select.samplers",
    "ReservoirSampler": "._select.samplers",
    "TopBottomSampler": "._select.samplers",
    "Watch": "._select.watch",
    "TraceSession": "._session",
    "install_shutdown_hooks": "._session",
    "SessionStats": "._stats",
    "SinkStats": "._stats",
    "SpoolStats": "._stats",
    "SyncTraceSession": "._sync",
    "AsyncTraceError": ".exceptions",
    "PermanentSinkError": ".exceptions",
    "RecordError": ".exceptions",
    "SessionClosedError": ".exceptions",
    "SpoolError": ".exceptions",
    "ConsoleSink": ".sinks",
    "JsonlSink": ".sinks",
    "MlflowSink": ".sinks",
    "ParquetSink": ".sinks",
    "Selected": ".sinks",
    "Sink": ".sinks",
    "TrackioSink": ".sinks",
    "WandbSink": ".sinks",
}


def __getattr__(name: str) -> Any:
    if name == "testing":
        return importlib.import_module(".testing", __name__)
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'asynctrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"
"""The package's version, as in pyproject.toml."""

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
    "recover",
    "testing",
]
