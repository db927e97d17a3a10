"""MlflowSink: each record as an MLflow trace linked to a run, metrics through `log_batch`."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import orjson

from .._checks import check_bool, check_seconds, check_type
from .._records.types import TraceRecord
from .._security import logger
from ..exceptions import PermanentSinkError
from ._base import Sink
from ._guard import Serial

__all__ = ["MlflowSink"]

_MISSING = 'MlflowSink needs MLflow: pip install "asynctrace[mlflow]"'

# MLflow's error codes that retrying cannot fix: a deleted run or experiment, a value it refuses,
# credentials it refuses, an API the server lacks. Others (TEMPORARILY_UNAVAILABLE, which is what
# a locked or unreachable database gives, INTERNAL_ERROR, REQUEST_LIMIT_EXCEEDED) are retried.
_PERMANENT_CODES = frozenset(
    {
        "RESOURCE_DOES_NOT_EXIST",
        "INVALID_PARAMETER_VALUE",
        "INVALID_STATE",
        "BAD_REQUEST",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "ENDPOINT_NOT_FOUND",
        "FEATURE_DISABLED",
        "NOT_IMPLEMENTED",
    }
)

# What MLflow accepts as a tag name (`validate_param_and_metric_name`), with its length limit.
_TAG_NAME = re.compile(r"[\w.\- :/]{1,250}")
_MAX_TAG_VALUE = 4096
# MLflow's preview limit for open-source tracking servers.
_MAX_PREVIEW = 1000
# MLflow accepts at most this many metrics in one `log_batch`.
_METRICS_PER_BATCH = 1000


def _tag_value(value: Any) -> str | None:
    """A scalar metadata value as the text a trace tag holds (a string longer than MLflow's
    limit cut to it); None for what is not a scalar."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value[:_MAX_TAG_VALUE]
    return None


# Tag naming the metadata keys whose tag value was cut to MLflow's limit (the span keeps them whole).
TRUNCATED_TAG = "asynctrace.truncated"


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, Mapping) else message
    text = content if isinstance(content, str) else orjson.dumps(content).decode()
    return text[:_MAX_PREVIEW]


def _permanent(exc: Exception) -> str | None:
    """Why MLflow's refusal cannot be fixed by retrying; None when retrying may help."""
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")
    kind = getattr(mlflow_exceptions, "MlflowException", None)
    if kind is not None and isinstance(exc, kind) and exc.error_code in _PERMANENT_CODES:
        return f"MLflow refused the call: {exc}"
    return None


# Seconds between looks at whether MLflow's first open has finished.
_PREPARE_POLL = 0.05


class _Preparation:
    """`fn()` on a daemon thread of its own, started at once; `done` is set when it returns."""

    def __init__(self, fn: Callable[[], None], give_up: float) -> None:
        self.give_up = give_up
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # handed to the open that waits for it
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, name="asynctrace-mlflow-open", daemon=True).start()


class MlflowSink(Sink):
    """Logs each record as one MLflow trace, linked to a run; metrics go to the run's metrics.

    The sink attaches to `run_id`, else to the run active (`mlflow.active_run()`) when it is
    made, else opens a run of its own and ends it at close. What a trace holds: docs/sinks/mlflow.md.
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_id: str | None = None,
        run_name: str | None = None,
        attach_active: bool = True,
        open_timeout: float = 300.0,
    ) -> None:
        check_type("tracking_uri", tracking_uri, str, "a str")
        check_seconds("open_timeout", open_timeout)
        check_type("experiment", experiment, str, "a str")
        check_type("run_id", run_id, str, "a str")
        check_type("run_name", run_name, str, "a str")
        check_bool("attach_active", attach_active)
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError(_MISSING)
        self.name = "mlflow"
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.open_timeout = open_timeout
        #: Tag values cut to MLflow's limit of 4,096 characters (their span keeps them whole).
        self.truncated_tags = 0
        self.experiment_id: str | None = None
        # Whether the run is this sink's own, which it ends at close.
        self.owns_run = False
        mlflow = sys.modules.get("mlflow")
        # An active run, or a tracking URI set in code, exists only where MLflow is imported
        # already: importing it here just to ask would cost the caller seconds.
        if mlflow is not None:
            current = mlflow.get_tracking_uri()
            # The active run lives in MLflow's current store: not one to attach to when the
            # sink is given another.
            if run_id is None and attach_active and tracking_uri in (None, current):
                active = mlflow.active_run()
                if active is not None:
                    self.run_id = active.info.run_id
            if tracking_uri is None:
                self.tracking_uri = current
        self._project = "asynctrace"
        self._run = "run"
        # Tags a run this sink opens, so that an open retried after a call that did create the
        # run (and was given up on) finds that run instead of opening a second.
        self._token = uuid.uuid4().hex
        self._client: Any = None
        self._tracing: Any = None
        self._prepared: tuple[Any, Any] | None = None
        self._prep: _Preparation | None = None
        self._prep_lock = threading.Lock()
        self._metrics_key: tuple[object, int] | None = None
        self._metrics_ms = 0
        # A timeout abandons a call stuck on a locked database or a server that stopped answering.
        self._io = Serial("MlflowSink", _permanent)

    # Sent to another process (a Ray collector) before it is opened: its preparation lock is
    # made anew there; a preparation under way cannot travel.
    def __getstate__(self) -> dict[str, object]:
        if self._prep is not None:
            raise TypeError("MlflowSink cannot be sent to another process once it started opening")
        return {k: v for k, v in vars(self).items() if k != "_prep_lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        vars(self).update(state)
        self._prep_lock = threading.Lock()

    def recovery_args(self) -> dict[str, Any] | None:
        # Called before open: run_id is the one given, or the active run the sink attached to.
        # The URI's credentials are left out where every spec is made (`_spec.describe_sinks`).
        return {
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
            "run_id": self.run_id,
            "run_name": self.run_name,
            "attach_active": False,
        }

    def bind(self, project: str, run: str) -> None:
        self._project = project
        self._run = run

    # -- opening -----------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Import MLflow and make its tracking store (a `sqlite:` store runs its migrations)."""
        if self._prepared is not None:
            return  # an earlier call, given up on, finished the job
        try:
            from mlflow.tracing.client import TracingClient
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise PermanentSinkError(f"{_MISSING} ({exc})") from exc
        try:
            client = MlflowClient(self.tracking_uri)
            tracing = TracingClient(client.tracking_uri)
            # The store is made on its first use: this cheap call makes it here.
            client.search_experiments(max_results=1)
        except ImportError as exc:
            # A `sqlite:` store needs SQLAlchemy and Alembic, which only the full package brings.
            raise PermanentSinkError(
                f"MLflow's tracking store needs a package that is missing ({exc}): pip install mlflow"
            ) from exc
        self._prepared = (client, tracing)

    def _open(self) -> None:
        if self._tracing is not None:
            return  # an earlier attempt, given up on, finished the job
        if self._prepared is None:
            raise RuntimeError("MlflowSink: MLflow is not prepared")
        client, tracing = self._prepared
        if self.run_id is not None:
            run = client.get_run(self.run_id)
            if run.info.lifecycle_stage != "active":
                raise PermanentSinkError(f"MLflow run {self.run_id} is deleted")
            self.experiment_id = run.info.experiment_id
        else:
            self.experiment_id = self._experiment_id(client)
            self.run_id = self._own_run(client, self.experiment_id)
            self.owns_run = True
        # Set last: a sink with `_tracing` set is open.
        self._client, self._tracing = client, tracing

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment or self._project
        found = client.get_experiment_by_name(name)
        if found is None:
            try:
                return str(client.create_experiment(name))
            except Exception:
                # Created meanwhile (another process, or an attempt given up on).
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage != "active":
            raise PermanentSinkError(f"MLflow experiment {name!r} is deleted")
        return str(found.experiment_id)

    def _own_run(self, client: Any, experiment_id: str) -> str:
        tag = "asynctrace.open"
        found = client.search_runs([experiment_id], f"tags.`{tag}` = '{self._token}'", max_results=1)
        if found:
            return str(found[0].info.run_id)
        run = client.create_run(
            experiment_id,
            run_name=self.run_name or self._run,
            tags={tag: self._token, "asynctrace.run": self._run},
        )
        return str(run.info.run_id)

    async def open(self) -> None:
        if self._prepared is None:
            await self._await_prepared()
        await self._io.run(self._open)

    async def _await_prepared(self) -> None:
        """Wait for MLflow's import and store creation, started once on a thread of its own.

        They take seconds, more on a loaded machine, so the retry policy's attempt deadline does
        not end this wait (its attempts could all run out while the first one still imports);
        `open_timeout` bounds it instead. Any other cancel (the session finishing) ends it at once.
        """
        with self._prep_lock:
            prep = self._prep
            if prep is None:
                prep = self._prep = _Preparation(self._prepare, anyio.current_time() + self.open_timeout)
        attempt_deadline = anyio.current_effective_deadline()
        while not prep.done.is_set():
            if anyio.current_time() >= prep.give_up:
                raise PermanentSinkError(
                    f"MlflowSink: importing MLflow and making its tracking store took over "
                    f"{self.open_timeout:g} s (open_timeout)"
                )
            if anyio.current_time() < attempt_deadline:
                await anyio.lowlevel.checkpoint()  # a cancel other than the attempt's deadline
            with anyio.CancelScope(shield=True):
                await anyio.sleep(_PREPARE_POLL)
        if prep.error is not None:
            with self._prep_lock:
                if self._prep is prep:
                    self._prep = None  # a retry starts afresh
            # Sorted as every other MLflow call's error is (`Serial`): a refusal no retry can fix
            # (a tracking URI of a scheme MLflow has no store for) fails the sink at once.
            why = _permanent(prep.error) if isinstance(prep.error, Exception) else None
            if why is not None:
                raise PermanentSinkError(why) from prep.error
            raise prep.error

    # -- traces ------------------------------------------------------------------------------

    def _trace_id(self, record_id: str) -> tuple[str, int]:
        # A retried write stores the same traces again under the same ids: MLflow merges them,
        # so a record is never held twice. The experiment is part of the id, as trace ids are
        # unique across a whole tracking store.
        digest = hashlib.blake2b(f"{self.experiment_id}\0{record_id}".encode(), digest_size=16).digest()
        otel_id = int.from_bytes(digest, "big")
        return f"tr-{otel_id:032x}", otel_id

    def _write(self, records: Sequence[TraceRecord]) -> None:
        from mlflow.entities import Span, TraceInfo, TraceLocation, TraceState

        experiment_id = self.experiment_id
        if self._tracing is None or experiment_id is None:
            raise RuntimeError("MlflowSink is not open")
        location = TraceLocation.from_experiment_id(experiment_id)
        run_id = str(self.run_id)
        spans = []
        for r in records:
            trace_id, otel_id = self._trace_id(r.id)
            sample = orjson.loads(r.payload)
            messages = sample.get("messages") or []
            metadata = sample.get("metadata") or {}
            last = messages[-1] if messages else None
            answered = isinstance(last, Mapping) and last.get("role") == "assistant"
            inputs = messages[:-1] if answered else messages
            asked = [m for m in inputs if isinstance(m, Mapping) and m.get("role") == "user"]
            tags = {
                "record_id": r.id,
                "step": str(r.step),
                "split": r.split,
                "key": r.key,
                "mlflow.traceName": r.key,
            }
            # A metadata key equal to a record tag, or in MLflow's own namespace, stays in the span.
            cut = []
            for name, value in metadata.items():
                text = _tag_value(value)
                if (
                    text is not None
                    and name not in tags
                    and not name.startswith("mlflow.")
                    and _TAG_NAME.fullmatch(name)
                ):
                    tags[name] = text
                    if isinstance(value, str) and len(value) > len(text):
                        cut.append(name)
            if cut:
                tags[TRUNCATED_TAG] = ",".join(cut)[:_MAX_TAG_VALUE]
                self._note_truncated(len(cut), cut[0])
            start_ms = int(r.timestamp * 1000)
            self._tracing.start_trace(
                TraceInfo(
                    trace_id=trace_id,
                    trace_location=location,
                    request_time=start_ms,
                    state=TraceState.OK,
                    request_preview=_text(asked[-1] if asked else ""),
                    response_preview=_text(last) if answered else None,
                    client_request_id=r.id,
                    execution_duration=0,
                    # The run's Traces tab, and `search_traces(run_id=...)`, find traces by this.
                    trace_metadata={"mlflow.sourceRun": run_id, "mlflow.trace_schema.version": "3"},
                    tags=tags,
                )
            )
            start_ns = start_ms * 1_000_000
            attributes = {
                "mlflow.traceRequestId": orjson.dumps(trace_id).decode(),
                "mlflow.spanType": '"CHAT_MODEL"',
                "mlflow.spanInputs": orjson.dumps({"messages": inputs}).decode(),
                "mlflow.spanOutputs": orjson.dumps(last if answered else None).decode(),
                "asynctrace.metadata": orjson.dumps(metadata).decode(),
            }
            for field in ("spans", "score"):
                if sample.get(field) is not None:
                    attributes[f"asynctrace.{field}"] = orjson.dumps(sample[field]).decode()
            spans.append(
                Span.from_dict(
                    {
                        "trace_id": base64.b64encode(otel_id.to_bytes(16, "big")).decode(),
                        "span_id": base64.b64encode((otel_id & (2**64 - 1) or 1).to_bytes(8, "big")).decode(),
                        "parent_span_id": None,
                        "name": r.key,
                        "start_time_unix_nano": start_ns,
                        "end_time_unix_nano": start_ns,
                        "status": {"code": "STATUS_CODE_OK", "message": ""},
                        "attributes": attributes,
                        "events": [],
                    }
                )
            )
        self._tracing.log_spans(experiment_id, spans)

    def _note_truncated(self, n: int, name: str) -> None:
        if not self.truncated_tags:
            logger.warning(
                "asynctrace: MlflowSink: metadata %r is longer than MLflow's %d-character tag limit: "
                "its tag is cut (named in the trace's %r tag); the span keeps the whole value",
                name,
                _MAX_TAG_VALUE,
                TRUNCATED_TAG,
            )
        self.truncated_tags += n

    async def write(self, records: Sequence[TraceRecord]) -> None:
        await self._io.run(self._write, records)

    # -- metrics -----------------------------------------------------------------------------

    def _write_metrics(self, step: int, metrics: Mapping[str, float], ms: int) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            raise RuntimeError("MlflowSink is not open")
        rows = [Metric(str(k), float(v), ms, step) for k, v in metrics.items()]
        for start in range(0, len(rows), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=rows[start : start + _METRICS_PER_BATCH])

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # A retry of the same metrics keeps their first timestamp: MLflow then stores the rows
        # of an attempt that did land once, not twice.
        last = self._metrics_key
        if last is None or last[0] is not metrics or last[1] != step:
            self._metrics_key = (metrics, step)
            self._metrics_ms = int(time.time() * 1000)
        await self._io.run(self._write_metrics, step, metrics, self._metrics_ms)

    # -- closing -----------------------------------------------------------------------------

    def _close(self) -> None:
        if self.owns_run and self._client is not None:
            self._client.set_terminated(self.run_id, "FINISHED")

    async def close(self) -> None:
        # Ending the run is a call like any other, which a stopped server or a locked database
        # can block: finish's deadline abandons it (the run is ended once the call gets through).
        await self._io.close(self._close)
