"""The sinks a setup file may name: a fixed registry of the kinds asynctrace ships.

A setup file is data (a spool directory gets copied between machines and people), so nothing
in it is imported or trusted as a path: it names a sink by its kind, recover makes that kind's
class from this table, passing only the arguments listed here, each path checked first. A
sink of the user's own is made only from a factory the user passes in code.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._security import shown
from ._base import Sink
from ._console import ConsoleSink
from ._jsonl import JsonlSink
from ._mlflow import MlflowSink
from ._parquet import ParquetSink
from ._trackio import TrackioSink
from ._wandb import WandbSink

__all__ = ["KINDS", "Kind", "check_args", "kind_of", "kind_of_class", "resolved_paths"]


def _where_trackio(args: Mapping[str, Any]) -> str:
    if args.get("space_id"):
        return f"Trackio Space {args['space_id']}"
    if args.get("server_url"):
        return f"Trackio server {args['server_url']}"
    return "Trackio's local storage ($TRACKIO_DIR or its default)"


def _where_wandb(args: Mapping[str, Any]) -> str:
    init = args.get("init_kwargs") or {}
    where = f"W&B project {init['entity'] + '/' if init.get('entity') else ''}{args.get('project')}"
    return where + (
        f" ({init['mode']}, in {init.get('dir') or 'the working directory'})" if init.get("mode") else ""
    )


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of sink a setup may name: its class, the keyword arguments recover may pass it
    (what its `recovery_args()` gives), which of them name a file or directory, and where it writes."""

    cls: type[Sink]
    args: frozenset[str]
    where: Callable[[Mapping[str, Any]], str]
    paths: tuple[str, ...] = ()  # "init_kwargs.dir": a key of a mapping argument
    nested: Mapping[str, frozenset[str]] = field(default_factory=dict)  # a mapping argument's keys
    # How a backend gets the credentials a URL of the setup was stored without.
    credentials: str = "from the backend's own environment variables"


KINDS: dict[str, Kind] = {
    "trackio": Kind(
        TrackioSink,
        frozenset({"project", "run", "space_id", "server_url", "process"}),
        _where_trackio,
        credentials="from TRACKIO_WRITE_TOKEN",
    ),
    "wandb": Kind(
        WandbSink,
        frozenset(
            {"project", "run", "table_prefix", "step_metric", "final_table", "commit", "finish_timeout"}
            | {"init_kwargs"}
        ),
        _where_wandb,
        paths=("init_kwargs.dir",),
        nested={"init_kwargs": frozenset({"entity", "mode", "dir", "group", "job_type"})},
        credentials="from WANDB_API_KEY",
    ),
    "mlflow": Kind(
        MlflowSink,
        frozenset({"tracking_uri", "experiment", "run_id", "run_name", "attach_active"}),
        lambda a: f"MLflow {a.get('tracking_uri') or 'tracking store (MLFLOW_TRACKING_URI or ./mlruns)'}",
        credentials="from MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD",
    ),
    "parquet": Kind(
        ParquetSink,
        frozenset({"directory", "max_records", "max_bytes", "compression_level", "stem", "fsync"}),
        lambda a: str(a.get("directory")),
        paths=("directory",),
    ),
    "jsonl": Kind(
        JsonlSink,
        frozenset({"path", "rotate_every", "fsync"}),
        lambda a: str(a.get("path")),
        paths=("path",),
    ),
    "console": Kind(ConsoleSink, frozenset({"max_chars"}), lambda a: "standard output"),
}

# Setups written before kinds named each sink's class instead: the classes of this table, by
# the names they had then. A name is only looked up here, never imported.
_BY_CLASS = {f"{k.cls.__module__}:{k.cls.__qualname__}": name for name, k in KINDS.items()}


def kind_of_class(cls: type[Sink]) -> str | None:
    """The kind of a sink of exactly this class (a subclass is the user's own sink)."""
    for name, kind in KINDS.items():
        if kind.cls is cls:
            return name
    return None


def kind_of(spec: Mapping[str, Any]) -> str | None:
    """The kind a spec names (by ``kind``, or by an older setup's ``class``), None for a sink
    of the user's own; a ValueError for a kind this release does not know."""
    kind = spec.get("kind")
    if kind is None:
        named = spec.get("class")
        return _BY_CLASS.get(named) if isinstance(named, str) else None
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"its kind {shown(kind)} is not one of asynctrace's sinks ({', '.join(KINDS)})")
    return kind


def _path_values(kind: Kind, args: Mapping[str, Any]) -> dict[str, Any]:
    """Each path argument of `kind` present in `args`, by its dotted name."""
    out: dict[str, Any] = {}
    for dotted in kind.paths:
        outer, _, inner = dotted.partition(".")
        value = args.get(outer)
        if inner:
            value = value.get(inner) if isinstance(value, Mapping) else None
        if value is not None:
            out[dotted] = value
    return out


def resolved_paths(kind: str, args: dict[str, Any]) -> dict[str, str]:
    """Make `kind`'s path arguments in `args` absolute (in place), and return where each leads
    now, symlinks resolved: recover checks that they still lead there."""
    spec = KINDS[kind]
    out: dict[str, str] = {}
    for dotted, value in _path_values(spec, args).items():
        if not isinstance(value, str):
            continue
        absolute = os.path.abspath(value)
        outer, _, inner = dotted.partition(".")
        if inner:
            args[outer] = {**args[outer], inner: absolute}
        else:
            args[outer] = absolute
        out[dotted] = os.path.realpath(absolute)
    return out


def check_args(kind: str, args: Any, resolved: Any) -> None:
    """A ValueError saying what is wrong when `args` are not what `kind` takes from a setup:
    an argument it does not list, or a path that is not absolute, holds a control character,
    leads elsewhere than when the session started (`resolved`), or whose directory is gone."""
    spec = KINDS[kind]
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ValueError("its arguments are not a mapping of names to values")
    unknown = sorted(set(args) - spec.args)
    if unknown:
        listed = ", ".join(shown(k) for k in unknown)
        raise ValueError(f"{spec.cls.__name__} takes no argument {listed} from a setup")
    for outer, keys in spec.nested.items():
        value = args.get(outer)
        if value is None:
            continue
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"its {outer} are not a mapping of names to strings")
        extra = sorted(set(value) - keys)
        if extra:
            raise ValueError(f"its {outer} hold {', '.join(shown(k) for k in extra)}, not taken from a setup")
    then = resolved if isinstance(resolved, dict) else {}
    for dotted, value in _path_values(spec, args).items():
        _check_path(kind, dotted, value, then.get(dotted))


def _check_path(kind: str, what: str, value: Any, then: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"its {what} is not a path: {shown(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"its {what} {shown(value)} holds NUL or a control character")
    if not os.path.isabs(value):
        raise ValueError(f"its {what} {shown(value)} is not an absolute path")
    now = os.path.realpath(value)
    if then is not None and now != then:
        raise ValueError(
            f"its {what} {shown(value)} leads to {shown(now)}, not to {shown(then)} as when the "
            "session started (a link changed, or the spool was moved)"
        )
    path = Path(value)
    if kind == "jsonl":
        _check_jsonl(path)
    elif path.exists() and not path.is_dir():
        raise ValueError(f"its {what} {shown(value)} is not a directory")
    elif not path.is_dir() and not path.parent.is_dir():
        raise ValueError(f"its {what} {shown(value)} is not here, nor is the directory it would be made in")


def _check_jsonl(path: Path) -> None:
    """Recover appends only to a file asynctrace wrote, or makes a new one next to others."""
    if not path.parent.is_dir():
        raise ValueError(f"its path {shown(str(path))}: the directory is not here")
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ValueError(f"its path {shown(str(path))} cannot be checked: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"its path {shown(str(path))} is not a regular file (a link, a device...)")
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    if first and not _is_jsonl_line(first):
        raise ValueError(f"its path {shown(str(path))} is a file that JsonlSink did not write")


def _is_jsonl_line(line: bytes) -> bool:
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and ({"id", "sample"} <= data.keys() or {"step", "metrics"} <= data.keys())
