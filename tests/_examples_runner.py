"""Runs scripts of `examples/` one after another in this process, as ``python examples/<name>.py``
would, each in a fresh working directory; writes what became of each to a JSON file.

One process for all of them: the examples share their imports (torch, transformers, Trackio),
which are most of what each costs on its own. Usage: ``python -m tests._examples_runner OUT NAME...``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _slime_from_its_source() -> None:
    """Make ``slime.utils.types`` importable from slime's file at the pinned commit (copied under
    tests/adapters/_upstream), as a clone of slime on PYTHONPATH would be."""
    from tests.adapters._upstream import slime_types

    for name in ("slime", "slime.utils"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    sys.modules["slime.utils.types"] = slime_types
    sys.modules["slime"].utils = sys.modules["slime.utils"]  # type: ignore[attr-defined]
    sys.modules["slime.utils"].types = slime_types  # type: ignore[attr-defined]


def main(out: str, names: list[str]) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    _slime_from_its_source()
    results: dict[str, dict[str, object]] = {}
    for name in names:
        path = ROOT / "examples" / f"{name}.py"
        os.chdir(tempfile.mkdtemp(prefix=f"example-{name}-"))
        sys.argv = [str(path)]
        started = time.perf_counter()
        error = None
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                error = f"SystemExit({exc.code!r})"
        except BaseException:  # reported to the test, which names the example
            error = traceback.format_exc()
        results[name] = {"error": error, "seconds": time.perf_counter() - started}
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
