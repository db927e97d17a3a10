"""A spool on a nearly full disk: a clear error, delivery goes on, and the loss is counted."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from tests.faults import _harness as h


def test_spool_writes_failing_for_lack_of_space_keep_delivering_and_count_the_loss(tmp_path: Path) -> None:
    """Under RLIMIT_FSIZE the spool fails (EFBIG); every record still reaches the sink, counted unspooled."""
    spool = tmp_path / "spool"
    proc = h.start_trainer(
        "--project", "disk-full", "--run", "r", "--spool", str(spool), "--durability", "enqueue",
        "--sink", "memory", "--steps", "60", "--per-step", "32", "--interval", "0",
        "--acked", os.devnull, "--stats", "-", "--fsize-limit", str(256 * 1024),
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    stats = orjson.loads(out.splitlines()[-1])
    assert stats["submitted"] == 60 * 32 and stats["check"]
    assert stats["written"] == stats["memory_records"] == 60 * 32
    assert stats["unspooled"] > 0
    assert "File too large" in stats["spool_error"]
    message = err.decode()
    assert message.count("cannot write to the spool") == 1, message
    assert "File too large" in message and "stats().spool.unspooled" in message
    # Nothing torn or unacknowledged is left behind: every record was delivered.
    assert not list(spool.glob("seg-*"))
