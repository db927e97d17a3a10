"""Offline W&B for a test module: the fixture, quiet run settings, the service process, a trainer's run."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

#: Settings that keep a test run quiet and small.
SETTINGS = {"console": "off", "x_disable_stats": True, "x_disable_meta": True, "silent": True}


@pytest.fixture(scope="module", autouse=True)
def offline_wandb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Offline W&B in a scratch directory; one service process for the whole module."""
    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(root))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_API_KEY", "")
        import wandb

        wandb.setup()
        yield root


def service() -> psutil.Process:
    """The wandb-core service process this process's runs talk to."""
    (core,) = [p for p in psutil.Process().children(recursive=True) if p.name() == "wandb-core"]
    return core


async def trainer_run(root: Path, name: str, interval: float = 0.05) -> Any:
    """A trainer's own run (opened in a thread), writing its `.wandb` file every `interval` s."""
    import wandb

    settings = wandb.Settings(**SETTINGS, x_transaction_log_flush_interval=interval)  # type: ignore[arg-type]
    return await anyio.to_thread.run_sync(
        lambda: wandb.init(project="p", name=name, dir=str(root), settings=settings)
    )


class Ticker:
    """A task ticking every millisecond on the event loop: `worst` is the longest gap it saw."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(0.001)
            now = time.monotonic()
            self.worst = max(self.worst, now - last)
            last = now


@contextlib.asynccontextmanager
async def ticking() -> AsyncIterator[Ticker]:
    """A `Ticker` running on the loop for the length of the block.

    The objects alive before it are frozen out of the garbage collector's reach meanwhile: a
    full collection of a heap that holds wandb takes about 0.1 s, a pause of the interpreter's
    that the ticker would otherwise blame on the loop's owner."""
    ticker = Ticker()
    gc.freeze()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            yield ticker
            tg.cancel_scope.cancel()
    finally:
        gc.unfreeze()
