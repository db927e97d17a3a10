"""The options of `asynctrace demo` (`DemoConfig`), apart from the demo itself: the command line
takes its flags' defaults from here without loading the demo's modules (most of any command's
start, `asynctrace view`'s included)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoConfig"]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Options of one demo run (the CLI's flags)."""

    project: str = "asynctrace-demo"
    run: str | None = None
    archive: str = "asynctrace-demo-archive"
    steps: int = 20
    workers: int = 8
    group_size: int = 8
    prompts_per_step: int = 8
    max_traces: int = 16
    max_staleness: int = 2
    seed: int = 0
    progress: bool = True
