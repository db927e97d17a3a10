"""A session's settings: `TraceSession`'s arguments, each checked once with an error naming it,
and resolved (run name, sampler, retry policy, default sink) into one frozen object."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._checks import (
    check_encoding,
    check_flags,
    check_int,
    check_ints,
    check_project_run,
    check_seconds,
    check_text,
)
from .._durable.spool import Durability
from .._records.groups import GroupKey
from .._records.types import Sample
from .._security import generated_run_name, shown
from .._select.base import Sampler
from .._select.samplers import SamplerName, resolve_sampler
from .._select.watch import Watch
from ..sinks._base import Sink
from .queue import OnFull
from .retry import NO_RETRY, RetryPolicy

__all__ = ["DEFAULT_RETRY", "Settings"]

_ON_FULL = ("block", "drop_newest", "drop_oldest")
_DURABILITY = ("writer", "enqueue")
DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """`TraceSession`'s arguments (see its docstring and docs/configuration.md), checked.

    Resolved on construction: `run` (a generated name when None), `sinks` (a `TrackioSink` when
    None), `sampler` (a built-in by name), `retry` (`NO_RETRY` when None), `health_interval`
    (None when `health_metrics` is False).
    """

    project: str
    run: str | None = None
    sinks: Sequence[Sink] | None = None
    max_traces_per_step: int | None = None
    sampler: SamplerName | Sampler = "first"
    queue_size: int = 10_000
    max_queue_bytes: int = 256 * 2**20
    on_full: OnFull = "block"
    batch_size: int = 256
    flush_interval: float = 1.0
    retry: RetryPolicy | None = DEFAULT_RETRY
    finish_timeout: float = 30.0
    trace_key: str = "{split}/traces"
    on_invalid: Literal["raise", "skip"] = "raise"
    max_open_steps: int = 2
    watch: Watch | None = None
    step_timeout: float | None = 300.0
    redact: Callable[[Sample], Sample] | None = None
    spool_dir: str | os.PathLike[str] | None = None
    durability: Durability = "writer"
    replay: bool = True
    shutdown_hooks: bool = False
    health_metrics: bool = True
    health_interval: float | None = 5.0
    group_key: GroupKey | None = None

    def __post_init__(self) -> None:
        self._check()  # every argument, before anything is resolved or built from them
        resolved: dict[str, Any] = {
            "run": self.run or generated_run_name(),
            "sinks": _checked_sinks(self.sinks),
            "sampler": resolve_sampler(self.sampler),
            "retry": self.retry if self.retry is not None else NO_RETRY,
            "flush_interval": float(self.flush_interval),
            "finish_timeout": float(self.finish_timeout),
            "health_interval": float(self.health_interval) if self.health_metrics else None,  # type: ignore[arg-type]
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    # The resolved values, typed as such (the fields keep the arguments' types).
    @property
    def run_name(self) -> str:
        assert isinstance(self.run, str)
        return self.run

    @property
    def sampler_in_use(self) -> Sampler:
        assert isinstance(self.sampler, Sampler)
        return self.sampler

    @property
    def sink_list(self) -> list[Sink]:
        return list(self.sinks or ())

    @property
    def retry_policy(self) -> RetryPolicy:
        assert self.retry is not None
        return self.retry

    def _check(self) -> None:
        check_project_run(self.project, self.run)
        check_int("max_traces_per_step", self.max_traces_per_step, allow_none=True)
        check_ints(
            queue_size=self.queue_size, max_queue_bytes=self.max_queue_bytes, batch_size=self.batch_size
        )
        check_int("max_open_steps", self.max_open_steps, minimum=0)
        check_seconds("flush_interval", self.flush_interval)
        check_seconds("finish_timeout", self.finish_timeout)
        check_seconds("step_timeout", self.step_timeout, allow_none=True)
        if self.on_full not in _ON_FULL:
            raise ValueError(f"on_full must be one of {_ON_FULL}, got {shown(self.on_full)}")
        check_encoding(self.on_invalid, self.redact)
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy or None, got {type(self.retry).__name__}")
        _check_trace_key(self.trace_key)
        if self.durability not in _DURABILITY:
            raise ValueError(f"durability must be one of {_DURABILITY}, got {shown(self.durability)}")
        spool_dir = self.spool_dir
        if spool_dir is not None and not isinstance(spool_dir, (str, os.PathLike)):
            raise ValueError(f"spool_dir must be a path or None, got {type(spool_dir).__name__}")
        if spool_dir is not None and not os.fspath(spool_dir):
            raise ValueError("spool_dir must not be empty")
        check_seconds("health_interval", self.health_interval)
        if self.watch is not None and not isinstance(self.watch, Watch):
            raise ValueError(f"watch must be an asynctrace.Watch, got {type(self.watch).__name__}")
        _check_group_key(self.group_key)
        check_flags(
            replay=self.replay, shutdown_hooks=self.shutdown_hooks, health_metrics=self.health_metrics
        )


def _check_trace_key(trace_key: Any) -> None:
    if not isinstance(trace_key, str) or not trace_key:
        raise ValueError(f"trace_key must be a non-empty str, got {shown(trace_key)}")
    check_text("trace_key", trace_key)
    try:
        trace_key.format(split="train")
    except Exception:  # KeyError, IndexError, ValueError, AttributeError ("{split.x}")
        # Not chained: the KeyError would quote a part of trace_key unscrubbed.
        raise ValueError(f"trace_key may only use the {{split}} field, got {shown(trace_key)}") from None


def _check_group_key(group_key: Any) -> None:
    if group_key is not None and not (
        callable(group_key)
        or isinstance(group_key, str)
        or (isinstance(group_key, (list, tuple)) and group_key and all(isinstance(k, str) for k in group_key))
    ):
        raise ValueError(
            "group_key must be a metadata key, a list of keys tried in order, or a function of "
            f"the metadata, got {shown(group_key)}"
        )


def _checked_sinks(sinks: Sequence[Sink] | None) -> tuple[Sink, ...]:
    if sinks is None:
        from ..sinks import TrackioSink

        sinks = [TrackioSink()]
    if isinstance(sinks, Sink):
        raise ValueError(f"sinks must be a list of sinks, got one {type(sinks).__name__}: pass [sink]")
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
        raise ValueError(f"sinks must be a list of asynctrace.Sink instances, got {type(sinks).__name__}")
    sinks = tuple(sinks)
    if not sinks:
        raise ValueError("sinks must name at least one sink (or be None for the default TrackioSink)")
    for sink in sinks:
        if not isinstance(sink, Sink):
            raise ValueError(f"sinks must be asynctrace.Sink instances, got {type(sink).__name__}")
    return sinks
