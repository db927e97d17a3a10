"""One rank of the TRL test under `torchrun --nproc-per-node 2` (gloo, CPU).

Usage: torchrun --nproc-per-node 2 _trl_torchrun.py PROJECT RUN OUT_DIR

Every rank attaches (the documented lines run on every rank), trains, then evaluates once more
after training; each writes what its reward functions and TRL computed to OUT_DIR/rank<N>.json.
The session is not finished by hand after the last evaluation: exit must finish it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asynctrace.adapters.trl_adapter import attach
from tests.adapters._trl_setup import Recorder, build_trainer


def main() -> None:
    project, run, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    recorder = Recorder()
    trainer = build_trainer(str(out / "trainer"), project, run, recorder)
    tracer = attach(trainer, max_traces_per_step=100, sampler="top_bottom")
    recorder.spy(trainer)
    trainer.train()
    after_train = tracer.session.stats() if tracer.session is not None else None
    trainer.evaluate()
    rank = trainer.accelerator.process_index
    report = {
        "batches": recorder.batches,
        "has_session": tracer.session is not None,
        "after_train": None
        if after_train is None
        else {
            "submitted": after_train.submitted,
            "written": after_train.written,
            "pending": after_train.pending,
            "dropped": dict(after_train.dropped),
            "check": after_train.check(),
        },
        "batches_logged": tracer.batches,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
