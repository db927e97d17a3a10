"""The Trackio side of `TrackioSink`: turns encoded records into Trackio traces.

It runs in a writer process by default (see `_trackio_worker`), or in a worker thread with
``TrackioSink(process=False)``. Kept free of asynctrace's event-loop code on purpose.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = ["HEADER", "TrackioWriter", "WriteItem"]

# Frame header of the writer-process protocol: the length of the orjson header that follows.
HEADER = struct.Struct(">I")

# (record id, step, trace key, encoded sample)
WriteItem = tuple[str, int, str, bytes]

TRACE_TYPE = "trackio.trace"


class TrackioWriter:
    """Owns one Trackio run. In local mode each batch is committed to SQLite before `write` returns."""

    def __init__(
        self,
        project: str,
        run: str,
        *,
        space_id: str | None = None,
        server_url: str | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.project = project
        self.run_name = run
        self.space_id = space_id
        self.server_url = server_url
        self.init_kwargs = dict(init_kwargs or {})
        self.run: Any = None
        self.finished = False

    @property
    def local(self) -> bool:
        return self.space_id is None and self.server_url is None

    def open(self) -> None:
        import trackio

        kwargs: dict[str, Any] = {
            "embed": False,
            "auto_log_cpu": False,
            "auto_log_gpu": False,
            "resume": "allow",
        }
        kwargs.update(self.init_kwargs)
        self.run = trackio.init(
            self.project,
            name=self.run_name,
            space_id=self.space_id,
            server_url=self.server_url,
            **kwargs,
        )

    def _config_once(self) -> dict[str, Any] | None:
        run = self.run
        if getattr(run, "_config_logged", True) or not run.config:
            return None
        from trackio import utils

        run._config_logged = True
        config: dict[str, Any] = utils.to_json_safe(run.config)  # type: ignore[no-untyped-call]
        return config

    def write(self, items: Sequence[WriteItem]) -> None:
        """One log entry per step, carrying that step's traces under their keys."""
        by_step: dict[int, tuple[str, dict[str, list[dict[str, Any]]]]] = {}
        for record_id, step, key, payload in items:
            sample = orjson.loads(payload)
            trace = {
                "_type": TRACE_TYPE,
                "messages": sample["messages"],
                "metadata": sample.get("metadata", {}),
                "spans": sample.get("spans") or [],
            }
            entry = by_step.get(step)
            if entry is None:
                # The log id is derived from the first record id, so a replayed batch maps
                # onto the same trace rows and Trackio's INSERT OR IGNORE keeps one copy.
                entry = by_step[step] = (f"at-{record_id}", {})
            entry[1].setdefault(key, []).append(trace)
        if self.local:
            from trackio.sqlite_storage import SQLiteStorage

            steps = list(by_step)
            SQLiteStorage.bulk_log(
                project=self.project,
                run=self.run.name,
                run_id=self.run.id,
                metrics_list=[by_step[s][1] for s in steps],
                steps=steps,
                log_ids=[by_step[s][0] for s in steps],
                config=self._config_once(),
            )
            return
        from trackio import Trace

        for step, (_, metrics) in by_step.items():
            self.run.log(
                {
                    key: [Trace(t["messages"], t["metadata"], t["spans"]) for t in traces]
                    for key, traces in metrics.items()
                },
                step=step,
            )

    def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.local:
            from trackio.sqlite_storage import SQLiteStorage

            SQLiteStorage.bulk_log(
                project=self.project,
                run=self.run.name,
                run_id=self.run.id,
                metrics_list=[dict(metrics)],
                steps=[step],
                log_ids=[uuid.uuid4().hex],
                config=self._config_once(),
            )
            return
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        if self.run is not None and not self.finished:
            self.run.finish()
        self.finished = True
