"""Ray integration: log rollout traces from many actors and tasks through one collector.

``TraceCollector`` is a Ray actor owning the job's `TraceSession`, so caps and samplers apply to
the whole step across every actor; ``TraceClient`` is used inside rollout actors and tasks and
never blocks them. Needs the ``ray`` extra: ``pip install 'asynctrace[ray]'``.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without ray
    raise ImportError(
        "asynctrace.ray needs Ray, which is not installed; install it with pip install 'asynctrace[ray]'"
    ) from exc

from ._client import ClientStats, TraceClient
from ._collector import RemoteTraceCollector as TraceCollector
from ._collector import start_collector
from ._sinkspec import SinkSpec

__all__ = ["ClientStats", "SinkSpec", "TraceClient", "TraceCollector", "start_collector"]
