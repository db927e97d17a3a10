"""A small archive written by the real sinks, and the viewer served over it for the view tests."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

import asynctrace as at
from asynctrace.sinks._parquet_sidecar import SIDECAR_FOLDER

STEPS = 5
GROUP = 4
PROMPTS = ("p-alpha", "p-beta", "p-gamma")
# p-beta's completions all get reward 1.0 at every step: a zero-signal group each time.
FLAT = "p-beta"
# p-gamma's completions carry token-level fields.
TOKENS = "p-gamma"


def _completion(prompt: str, step: int, i: int) -> tuple[str, float, str]:
    """(text, reward, stop reason): p-alpha gets better with the steps, p-gamma is cut short once."""
    if prompt == FLAT:
        return f"The answer is 4. (try {i})", 1.0, "stop"
    if prompt == "p-alpha":
        right = i < step
        text = (
            f"Step {step} work: 6 * 7 = {42 if right else 30 + i}. The answer is {42 if right else 30 + i}."
        )
        return text, (1.0 if right else 0.0) + 0.1 * i, "stop"
    truncated = i == 3
    return f"Let me think {'at length ' * (i + 1)}about {step}", 0.25 * i, "length" if truncated else "stop"


def _tokens(step: int, i: int) -> dict[str, list[Any]]:
    n = 6 + i
    return {
        "token_ids": [100 + step * 10 + k for k in range(n)],
        "loss_mask": [0, 0] + [1] * (n - 2),
        "logprobs": [-0.25 * k for k in range(n)],
        "advantages": [0.5 - 0.25 * i] * n,
    }


def samples(step: int, split: str) -> list[at.Sample]:
    out = []
    prompts = PROMPTS if split == "train" else PROMPTS[:1]
    for prompt in prompts:
        for i in range(GROUP):
            text, reward, stop = _completion(prompt, step, i)
            meta: dict[str, Any] = {
                "prompt_id": prompt,
                "group_uid": f"{split}-{step}-{prompt}",
                "reward": reward,
                "advantage": round(reward - 0.5, 4),
                "policy_version": step - (i % 2),
                "stop_reason": stop,
            }
            tokens = _tokens(step, i) if prompt == TOKENS else None
            if tokens is None:
                meta["response_len"] = len(text.split())
            out.append(
                at.Sample(
                    messages=[
                        {"role": "user", "content": f"Question of {prompt}: what is 6 * 7?"},
                        {"role": "assistant", "content": text},
                    ],
                    metadata=meta,
                    tokens=tokens,
                )
            )
    return out


def write(root: Path) -> tuple[Path, Path]:
    """Write the archive with a real session into `root`: (Parquet directory, JSONL file)."""
    parquet, jsonl = root / "archive", root / "jsonl" / "run.jsonl"

    async def main(steps: range) -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        sinks = [at.ParquetSink(parquet, process=False), at.JsonlSink(jsonl)]
        async with at.TraceSession("view-test", run="r", sinks=sinks, health_metrics=False) as session:
            for step in steps:
                await session.log_samples(samples(step, "train"), step=step)
                if step in (0, STEPS - 1):
                    await session.log_samples(samples(step, "eval"), step=step, split="eval")
        assert session.stats().check()

    # Two sessions, as a restarted trainer: two files, which the viewer reads as one archive.
    anyio.run(main, range(3))
    anyio.run(main, range(3, STEPS))
    return parquet, jsonl


def without_sidecars(source: Path, target: Path) -> Path:
    """`target`: a copy of the Parquet archive `source` without the sink's sidecars, as an archive
    written before them is (the viewer then reads the files themselves)."""
    target.mkdir(parents=True)
    for path in source.glob("*.parquet"):
        shutil.copy2(path, target / path.name)
    assert not (target / SIDECAR_FOLDER).exists()
    return target


@contextlib.contextmanager
def served(source: Path, watch: tuple[str, ...] = (), cache: Path | None = None) -> Iterator[str]:
    """The viewer over `source` (indexed first), served by uvicorn on a thread; yields its base URL."""
    from asynctrace.view import make_app

    with serving(make_app(source, watch=watch, cache=cache)) as base:
        yield base


def ready(base: str) -> Any:
    """The overview once the viewer at `base` has indexed its archive (it answers 503 until then)."""
    from ._html import get

    deadline = time.monotonic() + 30
    while (page := get(base, "/")).status == 503:
        assert time.monotonic() < deadline, "the viewer did not finish indexing"
        time.sleep(0.05)
    return page


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a thread, on a free port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the viewer did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
