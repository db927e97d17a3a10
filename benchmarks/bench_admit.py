"""What one capped ``log_samples`` call costs, best of many: the admitting call and the refused one.

Every step logs the same 1,024 samples (2.5 KB each, the same shuffled rewards, groups of 8 by
``prompt_index``) in batches of 32 to a session with ``max_traces_per_step=16`` and an
in-memory sink, so call `j` of every step does the same work. Each call's on-CPU time is kept
per call index, and the least over the steps (the run least disturbed by other processes)
is summed: once over the calls that took samples into the selection, once over those the cap
refused whole. The least of many repeats moves little with the machine's load, so two
versions of the code can be compared from separate runs.

With ``--phases`` the time of each stage of an admitting call (the encoder's work before the
buffer, the buffer's admission, the gate's offer inside it) is shown too, measured by
wrapping those methods (a wrapper adds well under a microsecond a call).

    python benchmarks/bench_admit.py
    python benchmarks/bench_admit.py --samplers top_bottom --phases
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any

import _common as common
import anyio

BATCH = 32
SAMPLERS = ("first", "top_bottom", "reservoir", "group")
REFERENCES = ("floor", "least top_bottom")  # bench_capped.py's, timed call by call here


class Phases:
    """Wraps methods to sum, per call of `log_samples`, the on-CPU time spent inside each."""

    def __init__(self) -> None:
        self.now: dict[str, float] = collections.defaultdict(float)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        now = self.now

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                now[label] += time.thread_time_ns() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def take(self) -> dict[str, float]:
        out = dict(self.now)
        self.now.clear()
        return out

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def install_phases() -> Phases:
    from asynctrace._engine import buffer, encoder, gated, intake

    phases = Phases()
    from asynctrace._select import gate

    phases.wrap(encoder.Encoder, "submit", "encoder.submit")
    phases.wrap(buffer.Buffer, "keeps", "  buffer.keeps")
    phases.wrap(encoder, "records_for", "  records_for")
    phases.wrap(gate.Gate, "offer", "    gate.offer")
    phases.wrap(gated.GatedAdmission, "room_needed", "    room_needed")
    phases.wrap(gated.GatedAdmission, "apply", "    apply")
    phases.wrap(encoder.Encoder, "_encode_places", "  validate+encode")
    phases.wrap(buffer.Buffer, "admit", "buffer.admit")
    phases.wrap(gated.GatedAdmission, "offer", "  gate offer")
    phases.wrap(intake.Intake, "_submit", "intake._submit")
    return phases


async def run(sampler: str, samples: list[Any], steps: int, phases: Phases | None) -> dict[str, Any]:
    import asynctrace as at
    from asynctrace.testing import MemorySink

    per_step = len(samples)
    n_calls = per_step // BATCH
    best = [float("inf")] * n_calls
    took = [0] * n_calls
    best_phase: list[dict[str, float]] = [{} for _ in range(n_calls)]
    kwargs = {"max_traces_per_step": 16, "sampler": common.make_sampler(sampler)}
    async with at.TraceSession("bench-admit", sinks=[MemorySink()], **kwargs) as session:
        for step in range(steps):
            for j in range(n_calls):
                batch = samples[j * BATCH : (j + 1) * BATCH]
                if phases is not None:
                    phases.take()
                t0 = time.thread_time_ns()
                got = await session.log_samples(batch, step=step)
                spent = time.thread_time_ns() - t0
                if phases is not None:
                    split = phases.take()
                    if spent < best[j]:
                        best_phase[j] = split
                if spent < best[j]:
                    best[j] = spent
                took[j] = got
                await anyio.sleep(0)  # the writer's turn, outside the timed call
    admitting = [j for j in range(n_calls) if took[j]]
    refused = [j for j in range(n_calls) if not took[j]]
    out: dict[str, Any] = {
        "admitting": (len(admitting), sum(best[j] for j in admitting) / 1e3),
        "refused": (len(refused), sum(best[j] for j in refused) / 1e3),
        "per_sample": sum(best) / 1e3 / per_step,
    }
    if phases is not None:
        sums: dict[str, float] = collections.defaultdict(float)
        for j in admitting:
            for label, ns in best_phase[j].items():
                sums[label] += ns / 1e3
        out["phases"] = {k: v / max(1, len(admitting)) for k, v in sums.items()}
    return out


async def reference(variant: str, samples: list[Any], steps: int) -> dict[str, Any]:
    """bench_capped.py's floor or least top_bottom over one step: the least over `steps`
    rounds of the time inside its calls (whole rounds: its calls share the step's heaps)."""
    import bench_capped

    timed = bench_capped.floor_round if variant == "floor" else bench_capped.least_round
    best = min([await timed(samples, per_step=len(samples), cap=16, gap=0.0) for _ in range(steps)])
    return {"admitting": (0, 0.0), "refused": (0, 0.0), "per_sample": best * 1e6 / len(samples)}


async def main_async(args: argparse.Namespace) -> int:
    common.print_machine("start")
    samples = common.shuffled_step(args.per_step)
    phases = install_phases() if args.phases else None
    rows = []
    details: list[tuple[str, dict[str, float]]] = []
    for sampler in [*REFERENCES, *args.samplers]:
        if sampler in REFERENCES:
            got = await reference(sampler, samples, args.steps)
        else:
            got = await run(sampler, samples, args.steps, phases)
        n_adm, t_adm = got["admitting"]
        n_ref, t_ref = got["refused"]
        rows.append(
            [
                sampler,
                f"{n_adm} / {t_adm / max(1, n_adm):.1f}",
                f"{n_ref} / {t_ref / max(1, n_ref):.1f}",
                f"{got['per_sample']:.3f}",
            ]
        )
        if "phases" in got:
            details.append((sampler, got["phases"]))
    print(
        f"least on-CPU time of one log_samples(batch of {BATCH}) call over {args.steps} identical "
        f"steps of {args.per_step}, cap 16, in-memory sink"
    )
    common.print_table(
        ["sampler", "admitting calls / us each", "refused calls / us each", "us/sample (sum of least)"], rows
    )
    for sampler, split in details:
        print(f"\n{sampler}: an admitting call's stages, us (mean over admitting calls of the least)")
        for label, us in split.items():
            print(f"  {label:<20} {us:7.1f}")
    common.print_machine("end")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="identical steps (repeats of each call)")
    p.add_argument("--per-step", type=int, default=1024)
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    p.add_argument("--phases", action="store_true", help="split an admitting call by stage")
    p.add_argument("--verbose", action="store_true", help="show stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return common.run_main(main_async, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
