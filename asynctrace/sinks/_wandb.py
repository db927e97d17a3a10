"""WandbSink: traces as incremental W&B tables, metrics through `run.log`."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from .._checks import check_bool, check_seconds, check_type, int64_or_none
from .._records.types import TraceRecord
from .._security import check_name, check_text, describe, logger
from ..exceptions import PermanentSinkError
from ._base import Sink
from ._guard import Serial
from ._wandb_ack import Acks, table_file
from ._wandb_txlog import LogTail

__all__ = ["WANDB_COLUMNS", "WandbSink"]


# An attached run that flushes its log less often than this makes every write wait as long.
_SLOW_FLUSH = 5.0

_MISSING = 'WandbSink needs the wandb package: pip install "asynctrace[wandb]"'

#: The columns of every trace table, in order.
WANDB_COLUMNS = (
    "id",
    "step",
    "split",
    "key",
    "timestamp",
    "conversation",
    "reward",
    "advantage",
    "policy_version",
    "stop_reason",
    "metadata",
    "messages",
)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    return wandb


def _number(value: Any) -> float | None:
    """A finite float for a numeric column, else None (the value stays in the metadata JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Multi-part content (OpenAI style): its text parts, other parts as JSON.
        return "\n".join(
            part["text"]
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else orjson.dumps(part, default=str).decode()
            for part in content
        )
    return "" if content is None else orjson.dumps(content, default=str).decode()


def render_conversation(messages: Sequence[Any]) -> str:
    """The conversation as plain text: one ``role: content`` paragraph a message."""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            parts.append(_text(message))
            continue
        text = _text(message.get("content"))
        calls = message.get("tool_calls")
        if calls:
            text = (text + "\n" if text else "") + "tool calls: " + orjson.dumps(calls, default=str).decode()
        parts.append(f"{message.get('role', '?')}: {text}")
    return "\n\n".join(parts)


def record_row(record: TraceRecord) -> list[Any]:
    """One table row for a record, in `WANDB_COLUMNS` order."""
    data = orjson.loads(record.payload)
    messages = data.get("messages") or []
    metadata = dict(data.get("metadata") or {})

    def column(name: str, convert: Callable[[Any], Any]) -> Any:
        # A value given a column of its own is left out of the `metadata` JSON column.
        value = convert(metadata.get(name))
        if value is not None:
            del metadata[name]
        return value

    columns = [column(name, _number) for name in ("reward", "advantage")]
    columns += [column("policy_version", int64_or_none), column("stop_reason", _str)]
    # The sample's score and spans go in the `metadata` column, under their names; where the
    # metadata has a key of that name already, under `sample.<name>`, so neither hides the other.
    for extra in ("score", "spans"):
        if data.get(extra) is not None:
            metadata[f"sample.{extra}" if extra in metadata else extra] = data[extra]
    return [
        record.id,
        record.step,
        record.split,
        record.key,
        record.timestamp,
        render_conversation(messages),
        *columns,
        orjson.dumps(metadata, default=str).decode(),
        orjson.dumps(messages, default=str).decode(),
    ]


# wandb.init arguments a recovery may reuse: where the run lives, never a credential or a config.
_RECOVERY_INIT_KEYS = ("entity", "mode", "dir", "group", "job_type")


class WandbSink(Sink):
    """Logs traces to Weights & Biases as one incremental table per trace key, and metrics with `run.log`.

    The sink opens (and finishes) a run of its own unless ``attach=True`` (`wandb.run`) or
    ``attach=<run>`` names the trainer's. When its logs commit W&B steps (on a run it opens, by
    default) or with ``wait_for_log=True``, a write returns once the run's `.wandb` file holds
    its rows. Attached, by default, a write hands its rows to W&B, which writes them with the
    trainer's step, and the session counts them written once the `.wandb` file holds them
    (`confirm`); ``wait_for_log=False`` counts them once handed over. Tables, columns, steps,
    acknowledgements and attached runs: docs/sinks/wandb.md.
    """

    def __init__(
        self,
        project: str | None = None,
        run: str | None = None,
        *,
        attach: Any = False,
        table_prefix: str | None = None,
        step_metric: str = "asynctrace/step",
        final_table: bool = True,
        commit: bool | None = None,
        finish_timeout: float = 5.0,
        log_flush_interval: float = 0.2,
        wait_for_log: bool | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            found = importlib.util.find_spec("wandb") is not None
        except ValueError:  # in sys.modules as None: imports of it are blocked
            found = False
        if not found:
            raise ImportError(_MISSING)
        for what, value in (("project", project), ("run", run)):
            if value is not None:
                check_name(what, value)
        for what, text in (("table_prefix", table_prefix), ("step_metric", step_metric)):
            if what == "table_prefix" and text is None:
                continue
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{what} must be a non-empty str, got {text!r}")
            check_text(what, text)
        check_bool("final_table", final_table)
        if commit is not None:
            check_bool("commit", commit)
        check_seconds("finish_timeout", finish_timeout)
        check_seconds("log_flush_interval", log_flush_interval)
        if wait_for_log is not None:
            check_bool("wait_for_log", wait_for_log)
        check_type("init_kwargs", init_kwargs, Mapping, "a mapping of wandb.init arguments")
        if attach is not False and init_kwargs:
            raise ValueError("init_kwargs configure a run the sink opens; an attached run is already open")
        self.name = "wandb"
        self.project = project
        self.run_name = run
        self.attach = attach
        self.table_prefix = table_prefix.rstrip("/") + "/" if table_prefix else ""
        self.step_metric = step_metric
        self.final_table = final_table
        self.commit = commit
        self.finish_timeout = float(finish_timeout)
        self.log_flush_interval = float(log_flush_interval)
        self.wait_for_log = wait_for_log
        self.init_kwargs = dict(init_kwargs or {})
        #: The W&B run written to, once open.
        self.wandb_run: Any = None
        #: True once the sink has finished the run it opened.
        self.finished = False
        self._owns = False
        self._tables: dict[str, Any] = {}
        self._defined: set[str] = set()
        # Attached, by default: writes hand rows over, `confirm` waits for them (see _open_run).
        self._defers = False
        # Rows handed to the trainer's open step and not confirmed yet (for the warning at close).
        self._unconfirmed = 0
        # The run was finished under the sink (by the trainer): W&B refuses calls on it.
        self._run_over = False
        # A deadline walks away from a call a stalled W&B service blocks; `_io` keeps the calls
        # in order on the run, and every call into wandb goes through it, on a daemon thread.
        self._io = Serial("WandbSink", _permanent)
        # What W&B has persisted: the run's `.wandb` file, read back (docs/sinks/wandb.md,
        # "Acknowledgements").
        self._acks = Acks(self._io, self._open_step, self._probe)

    def recovery_args(self) -> dict[str, Any] | None:
        if self.attach is not False:
            return None  # the trainer's own run: not one recover can open
        kept = {k: v for k, v in self.init_kwargs.items() if k in _RECOVERY_INIT_KEYS and isinstance(v, str)}
        return {
            "project": self.project,
            "run": self.run_name,
            "table_prefix": self.table_prefix.rstrip("/") or None,
            "step_metric": self.step_metric,
            "final_table": self.final_table,
            "commit": self.commit,
            "finish_timeout": self.finish_timeout,
            "init_kwargs": kept or None,
        }

    def bind(self, project: str, run: str) -> None:
        self.project = self.project or project
        self.run_name = self.run_name or run

    # -- in the worker thread ------------------------------------------------------------------

    def _open_run(self) -> None:
        if self.wandb_run is None:  # else an earlier attempt, given up on, did open it in the end
            self._start_run()
        self.wandb_run.define_metric(self.step_metric, hidden=True)
        # Rows logged without a commit (an attached run's default) are written with the trainer's
        # step, when the trainer moves on. A write that waited for that would hold the sink's
        # lane for a training step, one write a step (bench_wandb_ack.py), so by default a write
        # hands them over and `confirm` tells the session once the log holds them.
        waits = self._commits() if self.wait_for_log is None else self.wait_for_log
        self._defers = self.wait_for_log is None and not self._commits() and not self._owns
        if (waits or self._defers) and self._acks.tail is None and self._acks.unreadable is None:
            self._acks.tail = self._log_tail(self.wandb_run)
            if self._acks.tail is not None:
                # Reads the header, and loads wandb's Record type: a wandb whose log the reader
                # does not know is found out now, before any row is handed over.
                self._acks.tail.poll()

    def _start_run(self) -> None:
        wandb = _import_wandb()
        if self.attach is not False:
            run = wandb.run if self.attach is True else self.attach
            if run is None:
                raise PermanentSinkError(
                    "WandbSink(attach=True): wandb.run is None (no run is open, or it was made with "
                    "reinit='create_new', which leaves wandb.run unset): pass the run, attach=run"
                )
            self.wandb_run = run
            self._owns = False
        else:
            kwargs = dict(self.init_kwargs)
            kwargs.setdefault("project", self.project)
            kwargs.setdefault("name", self.run_name)
            # Another run of this process (the trainer's) stays open and current.
            kwargs.setdefault("reinit", "create_new")
            # wandb-core writes the run's `.wandb` file every flush interval (15 s by default):
            # a write is acknowledged once its rows are there, so this bounds its latency.
            ours = {
                "finish_timeout": self.finish_timeout,
                "x_transaction_log_flush_interval": self.log_flush_interval,
            }
            settings = kwargs.get("settings")
            if settings is None:
                kwargs["settings"] = wandb.Settings(**ours)
            elif isinstance(settings, Mapping):
                kwargs["settings"] = {**ours, **settings}
            elif isinstance(getattr(settings, "model_fields_set", None), set):
                # A wandb.Settings object: what it does not set itself.
                missing = {k: v for k, v in ours.items() if k not in settings.model_fields_set}
                kwargs["settings"] = settings.model_copy(update=missing)
            self.wandb_run = wandb.init(**kwargs)
            self._owns = True

    def _log_tail(self, run: Any) -> LogTail | None:
        settings = run.settings
        if not hasattr(settings, "sync_file"):
            # A wandb whose settings no longer name the file: what it cannot read, the sink
            # cannot confirm (Acks.refuse).
            self._acks.give_up("the run's settings name no sync_file")
            return None
        path = settings.sync_file
        if not path or getattr(settings, "x_skip_transaction_log", False):
            raise PermanentSinkError(
                "this W&B run keeps no .wandb transaction log (mode='disabled' or x_skip_transaction_log): "
                "the sink cannot tell that a row was persisted"
            )
        interval = getattr(settings, "x_transaction_log_flush_interval", None)
        if not self._owns and (not interval or interval > _SLOW_FLUSH):
            logger.warning(
                "asynctrace: the attached W&B run writes its .wandb file every %s; rows count as "
                "written only once there, so they wait as long (and a flush or finish with them): "
                "set x_transaction_log_flush_interval (seconds) lower in its wandb.Settings",
                f"{interval:g} s" if interval else "32 KiB block",
            )
        return LogTail(Path(path))

    def _define(self, keys: Sequence[str]) -> None:
        for key in keys:
            if key not in self._defined:
                self.wandb_run.define_metric(key, step_metric=self.step_metric)
                self._defined.add(key)

    def _log(self, data: dict[str, Any]) -> None:
        run = self.wandb_run
        if run is None:
            raise RuntimeError("WandbSink is not open")
        self._define([k for k in data if k != self.step_metric])
        run.log(data, commit=self._commits())

    def _commits(self) -> bool:
        """Whether the sink's logs commit W&B steps of their own."""
        return self._owns if self.commit is None else self.commit

    def _write_rows(self, records: Sequence[TraceRecord]) -> None:
        wandb = _import_wandb()
        book = self._acks.book
        reads = self._acks.tail is not None
        by_key: dict[str, list[TraceRecord]] = {}
        for r in records:
            if r.id not in book.logged:
                by_key.setdefault(r.key, []).append(r)
        for key, group in by_key.items():
            name = f"{self.table_prefix}{key}-incr"
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = wandb.Table(columns=list(WANDB_COLUMNS), log_mode="INCREMENTAL")
            before = len(table.data)
            for r in group:
                table.add_data(*record_row(r))
            try:
                self._log({name: table, self.step_metric: group[-1].step})
            except BaseException:
                # Not logged: the retry adds these rows again, so they must not stay behind.
                del table.data[before:]
                raise
            # Noted at once: whatever happens to the calls below, a retry logs these rows no more.
            log = book.add(name, [r.id for r in group])
            if self._defers:
                self._unconfirmed += len(group)
            if reads:
                log.file = table_file(table, Path(self.wandb_run.dir), name)
                if log.file is None:
                    self._acks.give_up("W&B's Table did not name the file it stored the rows of a log in")
                # The step the rows went into, or a later one (a blocking request to wandb-core):
                # the open step they joined, or, after a log that committed, the one before.
                step = _step_of(self.wandb_run)
                log.step = step - 1 if step is not None and self._commits() else step

    def _open_step(self) -> int | None:
        """The run's open W&B step (a request to wandb-core), or None when it does not say.

        Asked of a finished run, `Run.step` waits 30 s for an answer that never comes, holding
        up every call behind it: the probe, which W&B refuses at once then, goes first."""
        try:
            if not self._probe():
                return None
        except Exception:  # the service is gone: no step (the wait for rows says so)
            return None
        return _step_of(self.wandb_run)

    def _probe(self) -> bool:
        """Whether the run is still open; raises when its service process is gone."""
        if self._run_over:
            return False
        try:
            # Defining a metric again changes nothing (it adds a record to the log): W&B
            # refuses it on a finished run, and fails it when its service process is gone.
            self.wandb_run.define_metric(self.step_metric, hidden=True)
        except Exception as exc:
            if _refused(exc):
                self._run_over = True
                return False
            raise
        return True

    def _close(self) -> None:
        run = self.wandb_run
        if run is None:
            return
        if self._unconfirmed:
            logger.warning(
                "asynctrace: %d trace rows wait in the trainer's open W&B step, which W&B writes "
                "when the trainer logs its next step or finishes its run: they count as pending, "
                "not written (with a spool, they stay in it and the next session logs them again)",
                self._unconfirmed,
            )
        try:
            if self.final_table:
                wandb = _import_wandb()
                for key, incremental in self._tables.items():
                    if incremental.data:
                        final = wandb.Table(columns=list(WANDB_COLUMNS), data=list(incremental.data))
                        self._log({f"{self.table_prefix}{key}": final})
        finally:
            if self._owns:
                run.finish()
                self.finished = True

    # -- on the event loop -----------------------------------------------------------------------

    async def open(self) -> None:
        if self.attach is False and (self.project is None or self.run_name is None):
            raise PermanentSinkError("WandbSink needs a project and run (given or from the session)")
        await self._io.run(self._open_run)
        self._acks.check()  # a log it cannot read, found at open: said now, not at the first write

    @property
    def confirms_later(self) -> bool:
        return self._defers

    @property
    def degraded(self) -> str | None:
        """Why the sink cannot confirm rows any more (its `.wandb` log cannot be read), or None."""
        return self._acks.unreadable

    async def write(self, records: Sequence[TraceRecord]) -> None:
        self._acks.refuse()  # rows the sink could not confirm are not handed over
        await self._io.run(self._write_rows, records)
        if self._acks.tail is not None and not self._defers:
            await self._acks.persisted(records)

    async def confirm(self, records: Sequence[TraceRecord]) -> None:
        """Return once the run's `.wandb` file holds the rows of `records` (attached, by default)."""
        try:
            await self._acks.persisted(records)
        except PermanentSinkError:
            self._unconfirmed -= len(records)
            raise
        self._unconfirmed -= len(records)

    async def held_back(self, records: Sequence[TraceRecord]) -> bool:
        """True while the W&B step the rows of `records` went into is still the trainer's open
        one: W&B writes them only when the trainer logs its next step (or finishes the run)."""
        if not self._defers:
            return False
        return await self._acks.held_back(records)

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        data = {**metrics, self.step_metric: step}
        await self._io.run(self._log, data)

    async def close(self) -> None:
        await self._io.close(self._close)


def _step_of(run: Any) -> int | None:
    """The run's open W&B step; None when W&B does not say (`Run.step` waits up to 30 s for
    wandb-core, then raises): call it off the event loop."""
    try:
        return int(run.step)
    except Exception:
        return None


def _refused(exc: Exception) -> bool:
    """Whether `exc` is W&B refusing a call for good (`wandb.errors.UsageError`: the run was
    finished, an argument is wrong)."""
    errors = getattr(sys.modules.get("wandb"), "errors", None)
    usage = getattr(errors, "UsageError", None)
    return isinstance(usage, type) and isinstance(exc, usage)


def _permanent(exc: Exception) -> str | None:
    """Why what W&B raised cannot be fixed by retrying; None when retrying may help."""
    if isinstance(exc, ImportError):
        return describe(exc)
    if _refused(exc):
        # A finished run, a bad argument: the same call fails the same way again.
        return f"W&B refused the call: {describe(exc)}"
    if isinstance(exc, ConnectionError):
        # The connection to the W&B service process of this run is gone (it was killed or
        # crashed): wandb does not reconnect a run to a new one.
        return f"the W&B service process is gone: {describe(exc)}"
    return None
