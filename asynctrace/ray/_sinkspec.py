"""Sinks built inside the collector actor, for those that cannot be sent to it as they are."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..sinks._base import Sink

__all__ = ["SinkSpec", "build_sinks", "check_sendable"]


class SinkSpec:
    """A sink to build inside the collector: ``SinkSpec(MySink, *args, **kwargs)``.

    For a sink that cannot be pickled (it holds a connection, a lock, a thread): its class (or
    any picklable callable returning a `Sink`) and its arguments are sent, and the collector
    calls it. Arguments that are themselves `SinkSpec`s are built first, so a tier is
    ``SinkSpec(Selected, SinkSpec(MySink, url), max_traces_per_step=16)``.
    """

    def __init__(self, factory: Callable[..., Sink], /, *args: Any, **kwargs: Any) -> None:
        if not callable(factory):
            raise TypeError(f"SinkSpec needs a sink class or a callable, got {type(factory).__name__}")
        self.factory = factory
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"SinkSpec({getattr(self.factory, '__qualname__', self.factory)!s}, ...)"

    def build(self) -> Sink:
        """The sink, built here."""
        args = [a.build() if isinstance(a, SinkSpec) else a for a in self.args]
        kwargs = {k: v.build() if isinstance(v, SinkSpec) else v for k, v in self.kwargs.items()}
        sink = self.factory(*args, **kwargs)
        if not isinstance(sink, Sink):
            raise TypeError(f"{self!r} built a {type(sink).__name__}, not an asynctrace Sink")
        return sink


def build_sinks(sinks: Any) -> Any:
    """`sinks` (a session's `sinks` argument) with every `SinkSpec` built."""
    if isinstance(sinks, SinkSpec):
        return sinks.build()
    if isinstance(sinks, Sequence) and not isinstance(sinks, (str, bytes)):
        return [s.build() if isinstance(s, SinkSpec) else s for s in sinks]
    return sinks


def check_sendable(sinks: Any, dumps: Callable[[Any], bytes]) -> None:
    """Raise a `TypeError` naming the first sink that cannot be sent to the collector, and
    what to pass instead."""
    items = sinks if isinstance(sinks, Sequence) and not isinstance(sinks, (str, bytes)) else [sinks]
    for sink in items:
        try:
            dumps(sink)
        except Exception as exc:
            raise TypeError(
                f"sinks: {type(sink).__name__} cannot be sent to the collector actor ({exc}); pass "
                f"asynctrace.ray.SinkSpec({type(sink).__name__}, *args, **kwargs) to build it there, "
                "or a session_factory"
            ) from exc
