"""Sinks as plain data, and back: how a spool remembers the session's sinks for recovery.

A spec is a JSON object: the sink's ``name``, its ``kind`` (one of `_kinds.KINDS`; a sink of
the user's own has none, only its ``class`` for the summary to name) and its
`Sink.recovery_args`; for a `Selected` tier also its `max_traces_per_step` and sampler. Here,
the one place specs are made, every URL among the arguments loses its credentials (``withheld``
names the arguments that had some), and each path is made absolute with where it leads
(``resolved``), for recover to check. A sink that cannot be made again outside the trainer has
``args`` None. Making sinks back from specs trusts nothing in them: see `_kinds`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from .._security import describe, scrub_url, shown
from .._select.base import Sampler
from .._select.samplers import ReservoirSampler, resolve_sampler, sampler_name
from ._base import Sink
from ._kinds import KINDS, check_args, kind_of, kind_of_class, resolved_paths
from ._selected import Selected

__all__ = ["Maker", "Rebuilt", "SinkNote", "describe_sinks", "rebuild_kind", "rebuild_sinks"]

Maker = Callable[[Mapping[str, Any]], Sink]
"""Makes a sink from the arguments its spec holds (the user's own sinks, passed in code)."""

_BUILT_IN_SAMPLERS = ("first", "top_bottom", "reservoir")


class SinkNote(NamedTuple):
    """Something to say about one sink of a setup."""

    sink: str
    text: str


@dataclass(slots=True)
class Rebuilt:
    """The sinks some specs describe, made again, and what became of the others."""

    sinks: list[Sink] = field(default_factory=list)
    # By design not made outside the trainer (an in-memory sink, an attached run): they get nothing.
    unmade: list[SinkNote] = field(default_factory=list)
    # Named by the setup but not made (unknown kind, the user's own sink not passed, a bad
    # argument or path): their session's records stay in the spool for a later recover.
    refused: list[SinkNote] = field(default_factory=list)
    notes: list[SinkNote] = field(default_factory=list)  # made, with something to tell
    where: list[SinkNote] = field(default_factory=list)  # where each sink made writes


def _sampler_spec(sampler: Sampler) -> dict[str, Any] | None:
    name = sampler_name(sampler)
    if name is None:
        return None
    spec: dict[str, Any] = {"name": name}
    if isinstance(sampler, ReservoirSampler):
        spec["seed"] = sampler.seed
    return spec


def _without_credentials(value: Any) -> tuple[Any, bool]:
    """`value` (JSON) with every URL in it stripped of its credentials, and whether any was."""
    if isinstance(value, str):
        return scrub_url(value)
    if isinstance(value, list):
        items = [_without_credentials(v) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    if isinstance(value, dict):
        pairs = {k: _without_credentials(v) for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(c for _, c in pairs.values())
    return value, False


def _sink_spec(sink: Sink) -> dict[str, Any]:
    if isinstance(sink, Selected):
        tier = _sink_spec(sink.sink)
        k, sampler = sink.max_traces_per_step, _sampler_spec(sink.sampler)
        tier["selected"] = {"max_traces_per_step": k, "sampler": sampler}
        return tier
    cls = type(sink)
    kind = kind_of_class(cls)
    spec: dict[str, Any] = {"name": sink.name}
    if kind is None:
        spec["class"] = f"{cls.__module__}:{cls.__qualname__}"  # told, never imported
    else:
        spec["kind"] = kind
    try:
        args = sink.recovery_args()
        orjson.dumps(args)  # plain JSON values, or the sink cannot be made again
    except Exception:  # a user's sink: never a reason not to start the session
        args = None
    if isinstance(args, dict):
        clean: dict[str, Any] = {}
        withheld = []
        for key, value in args.items():
            clean[key], had = _without_credentials(value)
            if had:
                withheld.append(key)
        if withheld:
            spec["withheld"] = withheld
        resolved = resolved_paths(kind, clean) if kind is not None else None
        if resolved:
            spec["resolved"] = resolved
        args = clean
    spec["args"] = args
    return spec


def describe_sinks(sinks: Sequence[Sink]) -> list[dict[str, Any]]:
    """One spec per sink, before the session binds them (see the module docstring)."""
    return [_sink_spec(sink) for sink in sinks]


def _selection(spec: Mapping[str, Any]) -> tuple[int, Sampler | None] | None:
    """A tier's k and sampler (None: not a built-in one); None when the spec is no tier."""
    selected = spec.get("selected")
    if selected is None:
        return None
    k = selected.get("max_traces_per_step") if isinstance(selected, dict) else None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"its selection {shown(selected)} is not a tier's")
    sampler = selected.get("sampler")
    if sampler is None:
        return k, None
    name = sampler.get("name") if isinstance(sampler, dict) else None
    seed = sampler.get("seed", 0) if isinstance(sampler, dict) else None
    if name not in _BUILT_IN_SAMPLERS or not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"its selection's sampler {shown(sampler)} is not a built-in one")
    made = resolve_sampler(name)
    return k, ReservoirSampler(seed=seed) if isinstance(made, ReservoirSampler) else made


def _make(spec: Mapping[str, Any], name: str, makers: Mapping[str, Maker | None], out: Rebuilt) -> None:
    """Make the sink `spec` describes into `out`, or say there why not."""
    selection = _selection(spec)
    args = spec.get("args")
    if name in makers:
        maker = makers[name]
        if maker is None:
            out.unmade.append(SinkNote(name, "left out by the caller"))
            return
        sink = maker(args if isinstance(args, dict) else {})
        if not isinstance(sink, Sink):
            raise ValueError(
                f"the factory passed for it made a {type(sink).__name__}, not an asynctrace Sink"
            )
        out.where.append(SinkNote(name, "the sink passed in code"))
    else:
        kind = kind_of(spec)
        if args is None:
            out.unmade.append(SinkNote(name, "its recovery_args() is None"))
            return
        if kind is None:
            raise ValueError(
                f"it is a sink of your own ({shown(spec.get('class'))}), made only when you pass it "
                f"in code: await asynctrace.recover(spool_dir, sinks={{{name!r}: YourSink}})"
            )
        check_args(kind, args, spec.get("resolved"))
        sink = KINDS[kind].cls(**args)
        out.where.append(SinkNote(name, KINDS[kind].where(args)))
        withheld = spec.get("withheld")
        if isinstance(withheld, list) and withheld:
            out.notes.append(
                SinkNote(
                    name,
                    f"its {', '.join(shown(w) for w in withheld)} had credentials, which the setup "
                    f"does not keep: made without them; the backend takes them {KINDS[kind].credentials}",
                )
            )
    if selection is None:
        out.sinks.append(sink)
        return
    k, sampler = selection
    if isinstance(sink, Selected):
        out.sinks.append(sink)  # the caller's factory made the tier itself
    elif sampler is None:
        out.unmade.append(
            SinkNote(name, "its selection's sampler is not a built-in one and cannot be made again")
        )
    else:
        out.sinks.append(Selected(sink, max_traces_per_step=k, sampler=sampler))


def rebuild_sinks(specs: Sequence[Any], makers: Mapping[str, Maker | None] | None = None) -> Rebuilt:
    """The sinks the specs describe (`makers` make the user's own, by name; None leaves one
    out), and what became of each that was not made."""
    out = Rebuilt()
    for spec in specs:
        raw = spec.get("name") if isinstance(spec, dict) else None
        name = raw if isinstance(raw, str) and raw else "?"
        if not isinstance(spec, dict):
            out.refused.append(SinkNote(name, f"{shown(spec)} is not a sink's description"))
            continue
        if any(ord(c) < 32 or ord(c) == 127 for c in name):  # it is printed in the summary
            out.refused.append(SinkNote(shown(name), "its name holds a control character"))
            continue
        try:
            _make(spec, name, makers or {}, out)
        except Exception as exc:  # a bad argument, a missing extra, the user's factory failing
            why = str(exc) if isinstance(exc, ValueError) else describe(exc)
            out.refused.append(SinkNote(name, why))
    return out


def rebuild_kind(specs: Sequence[Any], kind: str) -> Rebuilt:
    """The sinks of `kind` the specs describe, a tier's as its plain sink (its selection, and
    whether its sampler can be made again, play no part), and no other sink made: what recover
    needs to reach a kind's files, such as a Parquet archive's journals."""
    return rebuild_sinks(
        [{k: v for k, v in spec.items() if k != "selected"} for spec in specs if _is_kind(spec, kind)]
    )


def _is_kind(spec: Any, kind: str) -> bool:
    if not isinstance(spec, dict):
        return False
    try:
        return kind_of(spec) == kind
    except ValueError:  # a kind this release does not know
        return False
