"""What one capped ``log_samples`` call executes, counted: Python bytecodes, by function.

bench_capped.py's and bench_admit.py's times move with the machine's load (by up to 2x between
runs of the same code on a shared machine); a count of the bytecodes a call executes does not.
Each sampler's session (``max_traces_per_step=16``, an in-memory sink) logs the same 1,024-sample
step (2.5 KB samples, rewards shuffled, groups of 8 by ``prompt_index``) in batches of 32, a
few steps over; the steps after the first ``--warm`` are counted with ``sys.settrace`` opcode
events, every frame inside the call, split into the calls that took samples in and those the cap
refused whole. "floor" counts bench_capped.py's floor (read each reward, keep the 16 best so
far) over the same calls. A count is not a time (a bytecode may cost a few nanoseconds or a
C function's microseconds; orjson's encoding and the heaps' C code count for nothing here),
but one that moves between two versions of the code says where their per-call work changed.

    python benchmarks/bench_bytecodes.py
    python benchmarks/bench_bytecodes.py --samplers top_bottom --top 20
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import sys
from types import FrameType
from typing import Any

import _common as common
import anyio

BATCH = 32
SAMPLERS = ("first", "top_bottom", "reservoir", "group")


class Counter:
    """Counts the bytecodes executed while on, by function (file:qualified name)."""

    def __init__(self) -> None:
        self.now: collections.Counter[str] = collections.Counter()

    def trace(self, frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            where = "/".join(code.co_filename.split("/")[-2:])  # the package folder and the file
            self.now[f"{where}:{code.co_qualname}"] += 1
        return self.trace

    def take(self) -> collections.Counter[str]:
        out, self.now = self.now, collections.Counter()
        return out


async def count_session(sampler: str, samples: list[Any], steps: int, warm: int) -> dict[bool, Any]:
    """Per kind of call (True: took samples in), the calls counted and their bytecodes by function."""
    import asynctrace as at
    from asynctrace.testing import MemorySink

    counter = Counter()
    sums: dict[bool, collections.Counter[str]] = {True: collections.Counter(), False: collections.Counter()}
    calls = {True: 0, False: 0}
    kwargs = {"max_traces_per_step": 16, "sampler": common.make_sampler(sampler)}
    async with at.TraceSession("bench-bytecodes", sinks=[MemorySink()], **kwargs) as session:
        for step in range(steps):
            for c in range(0, len(samples), BATCH):
                counting = step >= warm
                if counting:
                    sys.settrace(counter.trace)
                try:
                    got = await session.log_samples(samples[c : c + BATCH], step=step)
                finally:
                    sys.settrace(None)
                if counting:
                    sums[got > 0].update(counter.take())
                    calls[got > 0] += 1
                await anyio.sleep(0)  # the writer's turn, outside the counted call
    return {kind: (calls[kind], sums[kind]) for kind in (True, False)}


def count_floor(samples: list[Any]) -> int:
    """Bytecodes bench_capped.py's floor executes over one step's calls."""
    counter = Counter()
    held: list[float] = []
    sys.settrace(counter.trace)
    try:
        for c in range(0, len(samples), BATCH):
            batch = samples[c : c + BATCH]
            rewards = [s.metadata["reward"] for s in batch]
            held = heapq.nlargest(16, itertools.chain(held, rewards))
    finally:
        sys.settrace(None)
    return sum(counter.take().values())


async def main_async(args: argparse.Namespace) -> int:
    samples = common.shuffled_step(args.per_step)
    floor = count_floor(samples) / len(samples)
    rows = [["floor", "-", "-", f"{floor:.1f}", "1.00x"]]
    details = []
    for sampler in args.samplers:
        got = await count_session(sampler, samples, args.warm + args.steps, args.warm)
        (n_adm, adm), (n_ref, ref) = got[True], got[False]
        total = sum(adm.values()) + sum(ref.values())
        per_sample = total / (args.steps * len(samples))
        rows.append(
            [
                sampler,
                f"{n_adm} / {sum(adm.values()) / max(1, n_adm):.0f}",
                f"{n_ref} / {sum(ref.values()) / max(1, n_ref):.0f}",
                f"{per_sample:.1f}",
                common.fmt_ratio(per_sample / floor),
            ]
        )
        details.append((sampler, n_adm, adm, n_ref, ref))
    print(
        f"Python bytecodes executed inside log_samples(batch of {BATCH}), {args.steps} steps of "
        f"{args.per_step} after {args.warm}, cap 16, in-memory sink"
    )
    headers = ["variant", "admitting calls / bytecodes each", "refused / each", "per sample", "vs floor"]
    common.print_table(headers, rows)
    for sampler, n_adm, adm, n_ref, ref in details:
        for label, n, counts in (("admitting", n_adm, adm), ("refused", n_ref, ref)):
            if n:
                print(f"\n{sampler}, a {label} call's bytecodes by function (mean)")
                for name, k in counts.most_common(args.top):
                    print(f"  {k / n:8.1f}  {name}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="steps counted")
    p.add_argument("--warm", type=int, default=2, help="steps logged before counting")
    p.add_argument("--per-step", type=int, default=1024)
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    p.add_argument("--top", type=int, default=8, help="functions listed per kind of call")
    p.add_argument("--verbose", action="store_true", help="show stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
