"""How long one capped ``log_samples`` call's path is: the Python calls it makes, counted.

Each built-in sampler's session (``max_traces_per_step=16``, an in-memory sink) is given a
step's first 512 samples (1,024-sample steps, rewards shuffled, groups of 8 by
``prompt_index``, batches of 32), then one more batch of 32 is logged under ``sys.setprofile``:
every Python function that call enters is counted, with the files they are in; "session to
buffer" counts those in ``_session.py`` and ``_engine/`` (the sampler's own work and the
encoding of each kept sample left out). A call of the steady state, once the step's selection
is full: the usual call of a capped trainer.

    python benchmarks/call_path.py
    python benchmarks/call_path.py --show top_bottom
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import _common as common
import anyio

BATCH = 32
PER_STEP = 1024
BEFORE = 512  # samples of the step logged before the traced call


async def trace_one(sampler: str | None, samples: list[Any]) -> list[str]:
    """The functions (file:name) one `log_samples` call enters, in order."""
    import asynctrace as at
    from asynctrace.testing import MemorySink

    kwargs: dict[str, Any] = {}
    if sampler is not None:
        kwargs = {"max_traces_per_step": 16, "sampler": common.make_sampler(sampler)}
    seen: list[str] = []
    root = str(Path(at.__file__).parent.parent)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            where = name[len(root) + 1 :] if name.startswith(root) else Path(name).name
            seen.append(f"{where}:{code.co_name}")

    async with at.TraceSession("call-path", sinks=[MemorySink()], **kwargs) as session:
        for c in range(0, BEFORE, BATCH):
            await session.log_samples(samples[c : c + BATCH], step=0)
        await anyio.sleep(0.05)  # the writer has taken what was queued
        batch = samples[BEFORE : BEFORE + BATCH]
        sys.setprofile(profile)
        try:
            await session.log_samples(batch, step=0)
        finally:
            sys.setprofile(None)
    return seen[1:]  # the first "call" is the coroutine's own frame being resumed by setprofile


async def main_async(args: argparse.Namespace) -> int:
    samples = common.shuffled_step(PER_STEP)
    rows = []
    for sampler in args.samplers:
        seen = await trace_one(None if sampler == "no cap" else sampler, samples)
        ours = [s for s in seen if s.startswith("asynctrace/")]
        files = {s.split(":")[0] for s in ours}
        # The path from the session to the buffer: the sampler's own work and the encoding of
        # each kept sample (per sample, not per call) left out.
        path = [s for s in ours if s.startswith(("asynctrace/_session.py", "asynctrace/_engine/"))]
        rows.append([sampler, str(len(seen)), str(len(ours)), str(len(path)), str(len(files))])
        if sampler == args.show:
            for name, n in collections.Counter(seen).most_common():
                print(f"{n:4d}  {name}")
            print()
    print(f"one log_samples(batch of {BATCH}) call after {BEFORE} of a step's {PER_STEP} samples, cap 16")
    common.print_table(
        ["sampler", "python calls", "in asynctrace", "session to buffer (_session, _engine)", "files"], rows
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = ["no cap", "first", "top_bottom", "reservoir", "group", "group_unsized"]
    p.add_argument("--samplers", nargs="+", default=choices, choices=choices)
    p.add_argument("--show", choices=choices, help="list the calls of this sampler's trace")
    p.add_argument("--verbose", action="store_true", help="show stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
