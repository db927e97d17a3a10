"""The selection tools together across two gloo ranks: a cap (none, top_bottom, whole groups),
the watch list and a Selected tier, data dealt to the ranks in shuffled order, against the
one-process oracle of tests/_composition.py (written from the docs)."""

from __future__ import annotations

import json
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests._composition import WATCHED, Cap, Row, oracle, watched_rows  # noqa: E402
from tests._group_oracle import pick  # noqa: E402
from tests.distributed import _composition_worker as worker  # noqa: E402

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[dict[str, Any]]]:
    """Both ranks run every case in one process group, once for the module."""
    from torch.multiprocessing.spawn import spawn

    project = f"compose-{uuid.uuid4().hex[:10]}"
    with tempfile.TemporaryDirectory() as out:
        spawn(  # type: ignore[no-untyped-call]
            worker.run, args=(WORLD, _free_port(), project, out), nprocs=WORLD, join=True
        )
        yield [json.loads((Path(out) / f"compose{r}.json").read_text()) for r in range(WORLD)]


def _oracle_cap(cap: tuple[str, int] | None) -> Cap:
    """The cap as the oracle takes it; whole groups by tests/_group_oracle.py."""
    if cap is None or not cap[0].startswith("group-"):
        return cap
    policy, k = cap[0].removeprefix("group-"), cap[1]

    def groups(rows: list[Row], step: int) -> set[str]:
        chosen = pick([(r.prompt_id, r.reward) for r in rows], k, policy, seed=worker.GROUP_SEED, step=step)
        return {rows[i].uid for i in chosen}

    return groups  # type: ignore[return-value]


def _sets(held: dict[str, list[str]]) -> dict[int, set[str]]:
    return {int(step): set(uids) for step, uids in held.items()}


@pytest.mark.parametrize("case", worker.CASES, ids=[worker.case_id(c) for c in worker.CASES])
def test_every_sink_holds_what_one_process_would(
    ranks: list[dict[str, Any]], case: tuple[str, bool, bool]
) -> None:
    """Each sink (the writing rank's in global mode, each rank's own otherwise) holds the oracle's
    pick per step: watched samples marked and in every step they were logged in, the watch's
    budget spent once over the ranks (rank order, then arrival), groups whole, nothing late,
    and the accounting of every rank and session exact."""
    index = worker.CASES.index(case)
    cap_name, watch, tier = case
    mode, cap = worker.CAPS[cap_name]
    dealt = worker.shares(index, worker.case_steps(index, cap_name))
    # Global mode writes what one process logging rank after rank would; the per-rank modes are
    # one process each.
    views = (
        [(0, [d[0] + d[1] for d in dealt])]
        if mode == "global"
        else [(r, [d[r] for d in dealt]) for r in range(WORLD)]
    )
    for rank, steps in views:
        got = ranks[rank][worker.case_id(case)]
        want_plain, want_tier = oracle(
            steps, _oracle_cap(cap), worker.TIER if tier else None, watch, worker.WATCH_BUDGET
        )
        assert _sets(got["plain"]) == {s: v for s, v in want_plain.items() if v}, rank
        if tier:
            assert _sets(got["tracker"]) == {s: v for s, v in want_tier.items() if v}, rank
        want_watched = {
            s: {r.uid for r in watched_rows(rows, worker.WATCH_BUDGET)} for s, rows in enumerate(steps)
        }
        assert _sets(got["watched"]) == ({s: v for s, v in want_watched.items() if v} if watch else {}), rank
        if watch:
            logged = {s for s, rows in enumerate(steps) if any(r.prompt_id == WATCHED for r in rows)}
            assert logged <= {int(s) for s in got["watched"]}
        if cap is not None and cap[0].startswith("group-"):
            by_uid = {r.uid: r for rows in steps for r in rows}
            for uids in got["plain"].values():
                prompts = [by_uid[u].prompt_id for u in uids]
                assert all(prompts.count(p) == worker.GROUP_SIZE for p in prompts if p != WATCHED)

        session, stats = got["session"], got["rank"]
        assert session["check"] and session["pending"] == 0
        assert session["written"] == sum(len(v) for v in want_plain.values())
        assert "late" not in session["dropped"]
        assert all("late" not in sink["skipped"] for sink in session["sinks"].values())
        assert stats["check"] and stats["held"] == 0 and "late" not in stats["dropped"]
        assert stats["merged_late"] == 0

    if mode == "global":
        every = ranks[0][worker.case_id(case)]["gathered"]
        writer, session = every[0], every[0]["session"]
        assert all(s["submitted"] == s["handed_on"] + s["held"] + sum(s["dropped"].values()) for s in every)
        assert sum(s["submitted"] for s in every) == sum(
            len(rows) for rows in worker.case_steps(index, cap_name)
        )
        assert writer["merged_received"] == sum(s["handed_on"] for s in every)
        assert (
            writer["merged_received"]
            == writer["merged_capped"] + writer["merged_late"] + session["submitted"]
        )
        assert ranks[1][worker.case_id(case)]["session"] is None


def test_the_distributed_page_snippet_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/distributed.md's watch-and-tier snippet, run as written (a world of one): the archive
    gets the step's 64 plus the watched prompt's 8, the tracker tier its 16 plus those 8."""
    import random
    import textwrap

    text = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (snippet,) = [b for b in blocks if "watch=at.Watch" in b and "DistributedTraceLogger(" in b]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    scope: dict[str, Any] = {}
    exec(compile(textwrap.dedent(snippet), "distributed.md", "exec"), scope)
    traces = scope["traces"]
    rng = random.Random(0)
    for step in range(2):
        rows = [
            {
                "prompt": f"q{g}",
                "response": f"a{i}",
                "reward": rng.random(),
                "group_uid": prompt,
                "prompt_id": prompt,
                "uid": f"{step}-{g}-{i}",
            }
            for g, prompt in enumerate(["gsm8k-0042", *(f"p{step}-{g}" for g in range(10))])
            for i in range(8)
        ]
        rng.shuffle(rows)
        traces.log_samples(rows, step=step)
        traces.end_step(step)
    stats = traces.finish(60.0)
    sinks = stats.session.sinks
    assert sinks["trackio"].written == 2 * (16 + 8) and sinks["jsonl"].written == 2 * (64 + 8)
    assert stats.check() and stats.session.check() and stats.session.pending == 0
    import json as _json

    lines = [_json.loads(line) for line in (tmp_path / "traces" / "run.jsonl").read_text().splitlines()]
    traced = [r for r in lines if "sample" in r]  # the others are run metrics
    assert len(traced) == 2 * (64 + 8)
    watched = [r for r in traced if r["sample"]["metadata"]["prompt_id"] == "gsm8k-0042"]
    assert sorted(r["step"] for r in watched) == [0] * 8 + [1] * 8


def test_a_watch_given_to_the_wrong_place_is_refused() -> None:
    """The logger applies the watch in "global" and "per_rank" modes, the session in
    "per_rank_stream": a watch on the other one, or not a Watch, is a ValueError naming it."""
    import asynctrace as at
    from asynctrace.distributed import DistributedTraceLogger
    from asynctrace.testing import MemorySink

    watch = at.Watch(ids=[WATCHED])
    with pytest.raises(ValueError, match="give watch= to DistributedTraceLogger"):
        DistributedTraceLogger(
            "p",
            "r",
            max_traces_per_step=4,
            session_factory=lambda rank, run: at.TraceSession("p", run, sinks=[MemorySink()], watch=watch),
        )
    with pytest.raises(ValueError, match="the watch list is the session's"):
        DistributedTraceLogger(
            "p",
            "r",
            mode="per_rank_stream",
            watch=watch,
            session_factory=lambda rank, run: at.TraceSession("p", run, sinks=[MemorySink()]),
        )
    with pytest.raises(ValueError, match=r"watch must be an asynctrace\.Watch"):
        DistributedTraceLogger("p", "r", max_traces_per_step=4, watch=[WATCHED])  # type: ignore[arg-type]
