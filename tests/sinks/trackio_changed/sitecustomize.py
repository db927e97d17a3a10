"""On a process's PYTHONPATH, this makes Trackio's private bulk commit look as a later release's
might: `SQLiteStorage.bulk_log` taking only ``*args, **kwargs``, so TrackioSink's check finds none
of the keywords it passes and writes through the public API. Trackio's own `run.log` calls
`bulk_log` by name, so it keeps working (removing the attribute would break Trackio itself).

The change is made when the process imports Trackio's storage module, so a process that never
does (the trainer: its sink's writer process imports Trackio) does not pay for importing it.
Used by tests/sinks/test_trackio_paths.py and benchmarks/bench_trainer_cpu.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_MODULE = "trackio.sqlite_storage"


def _change(module: ModuleType) -> None:
    storage = module.SQLiteStorage
    bulk_log = storage.bulk_log

    def changed(*args: Any, **kwargs: Any) -> Any:
        return bulk_log(*args, **kwargs)

    storage.bulk_log = staticmethod(changed)


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds Trackio's storage module as usual, and changes it once it has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None:
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _change(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _OnImport())
