"""Sinks as plain data, and back: how a spool remembers the session's sinks for recovery.

A spec is a JSON object: the sink's class (``module:qualname``) and `Sink.recovery_args`; for a
`Selected` tier also its `max_traces_per_step` and sampler. No credential goes into one (see
`Sink.recovery_args`); a sink that cannot be made again outside the trainer has ``args`` None.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from .._select.base import Sampler
from .._select.samplers import ReservoirSampler, resolve_sampler, sampler_name
from ._base import Sink
from ._selected import Selected

__all__ = ["describe_sinks", "rebuild_sinks"]


def _sampler_spec(sampler: Sampler) -> dict[str, Any] | None:
    name = sampler_name(sampler)
    if name is None:
        return None
    spec: dict[str, Any] = {"name": name}
    if isinstance(sampler, ReservoirSampler):
        spec["seed"] = sampler.seed
    return spec


def _sink_spec(sink: Sink) -> dict[str, Any]:
    if isinstance(sink, Selected):
        spec = _sink_spec(sink.sink)
        k, sampler = sink.max_traces_per_step, _sampler_spec(sink.sampler)
        spec["selected"] = {"max_traces_per_step": k, "sampler": sampler}
        return spec
    cls = type(sink)
    try:
        args = sink.recovery_args()
    except Exception:  # a user's sink: never a reason not to start the session
        args = None
    return {"name": sink.name, "class": f"{cls.__module__}:{cls.__qualname__}", "args": args}


def describe_sinks(sinks: Sequence[Sink]) -> list[dict[str, Any]]:
    """One spec per sink, before the session binds them (see the module docstring)."""
    return [_sink_spec(sink) for sink in sinks]


def _make(spec: Mapping[str, Any]) -> Sink:
    args = spec.get("args")
    if not isinstance(args, dict):
        raise ValueError("it cannot be made outside the trainer (no recovery_args)")
    module, _, qualname = str(spec.get("class", "")).partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"its class {spec.get('class')!r} cannot be imported: {exc}") from None
    if not (isinstance(target, type) and issubclass(target, Sink)):
        raise ValueError(f"{spec.get('class')!r} is not an asynctrace.Sink")
    sink: Sink = target(**args)
    selected = spec.get("selected")
    if selected is None:
        return sink
    sampler = selected.get("sampler")
    if not isinstance(sampler, dict):
        raise ValueError("its selection's sampler is not a built-in one and cannot be made again")
    made = resolve_sampler(sampler["name"])
    if isinstance(made, ReservoirSampler):
        made = ReservoirSampler(seed=sampler.get("seed", 0))
    return Selected(sink, max_traces_per_step=int(selected["max_traces_per_step"]), sampler=made)


def rebuild_sinks(specs: Sequence[Mapping[str, Any]]) -> tuple[list[Sink], list[tuple[str, str]]]:
    """The sinks the specs describe, and (name, why) for each that could not be made."""
    sinks: list[Sink] = []
    problems: list[tuple[str, str]] = []
    for spec in specs:
        name = str(spec.get("name", "?"))
        try:
            sinks.append(_make(spec))
        except Exception as exc:  # an argument the class no longer takes, a missing extra
            why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            problems.append((name, why))
    return sinks, problems
