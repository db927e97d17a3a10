"""The overview and find as a new user meets them: the watch list first, train before eval, steps
counted once, find by any id, a folder of runs named as such, and records without an integer step
left out and counted (never a "None" step whose link fails)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _agentic, _archive  # noqa: E402
from ._html import get  # noqa: E402
from ._tree import parse  # noqa: E402


@pytest.fixture(scope="module")
def archive(agentic_archive: tuple[Path, Path]) -> tuple[Path, Path]:
    return agentic_archive


@pytest.fixture(scope="module")
def base(archive: tuple[Path, Path]) -> Iterator[str]:
    with _archive.served(archive[0], watch=("p-down", "p-unknown")) as url:
        yield url


def test_overview_puts_the_watch_list_first_train_before_eval_and_counts_steps_once(base: str) -> None:
    """The watched prompts come before every split; train's table before eval's; a 6-step run with
    eval at two of its steps is "6 steps"."""
    page = get(base, "/")
    html = page.html
    assert html.index('class="prompts watched"') < html.index("<h2>split")
    assert html.index("split <code>train</code>") < html.index("split <code>eval</code>")
    assert page.values["steps"] == str(_agentic.STEPS)
    tables = parse(html).all("table", "steps")
    assert [t.all("tr")[1].attrs["data-split"] for t in tables] == ["train", "eval"]


def test_find_matches_record_group_and_prompt_ids(base: str, archive: tuple[Path, Path]) -> None:
    """An id goes to its record, its prompt's history or its group; one naming groups at several
    steps lists them; an id of nothing is a 404 saying what was looked for."""
    record = duckdb.execute(f"SELECT id FROM '{archive[0]}/*.parquet' LIMIT 1").fetchone()[0]
    cases = {
        record: "/record?" + urlencode({"id": record}),
        "p-tools": "/prompt?id=p-tools&split=train",
        "w3-tools": "/group?split=train&step=3&group=w3-tools",
    }
    for name, location in cases.items():
        found = get(base, "/find?" + urlencode({"id": name}))
        assert (found.status, found.location) == (303, location), name
        assert get(base, location).status == 200
    listed = get(base, "/find?id=e-up")  # the eval group id at steps 0 and 5
    assert listed.status == 200
    assert "/group?split=eval&step=0&group=e-up" in listed.links
    assert "/group?split=eval&step=5&group=e-up" in listed.links
    missing = get(base, "/find?id=nothing-here")
    assert (
        missing.status == 404
        and "no record, group or prompt with id &#x27;nothing-here&#x27;" in missing.html
    )


def test_a_folder_of_runs_says_which_runs_it_holds(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """`asynctrace view` on the folder above runs names them and how to view one, exit 1."""
    runs = tmp_path / "runs"
    shutil.copytree(archive[0], runs / "run-a")
    shutil.copytree(archive[1].parent, runs / "run-b")
    (runs / ".hidden").mkdir()
    command = [sys.executable, "-m", "asynctrace", "view", str(runs), "--port", "0", "--no-cache"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"{runs} holds no archive files but 2 runs (run-a, run-b): view one of them" in result.stderr
    assert f"asynctrace view {runs / 'run-a'}" in result.stderr


def _line(record: str, step: object, **fields: object) -> str:
    line = {"id": record, "step": step, "split": "train", "key": "k", "timestamp": 1.0}
    line.update(fields)
    line["sample"] = {"messages": [{"role": "user", "content": "q"}], "metadata": {"reward": 1.0}}
    return json.dumps(line)


def test_a_jsonl_line_without_an_integer_step_is_left_out_and_counted(tmp_path: Path) -> None:
    """Steps of 1.5, "7", true, null, none at all or beyond int64, an id that is no string and a
    line that is no JSON: each left out and counted by reason on the overview; every step link
    shown answers."""
    path = tmp_path / "run.jsonl"
    bad = [1.5, "7", True, None, 10**30]
    lines = [_line("good-1", 1), _line("good-2", 2)] + [_line(f"bad-{i}", s) for i, s in enumerate(bad)]
    lines += [
        json.dumps({"id": "no-step", "split": "train", "sample": {}}),
        _line("x", 3).replace('"x"', "7"),
    ]
    lines.append('{"id": "cut", "step": 4, "spl')
    path.write_text("\n".join(lines) + "\n")
    with _archive.served(path) as base:
        page = get(base, "/")
        steps = [b.attrs["data-step"] for b in page.blocks if b.tag == "tr" and "data-step" in b.attrs]
        assert steps == ["1", "2"] and page.values["records"] == "2"
        assert (
            "run.jsonl</code>: 8 lines left out: 6 no integer step, 1 no string id, 1 not a record"
            in page.html
        )
        for link in page.links:
            assert get(base, link).status in (200, 303), link


def test_a_parquet_step_that_is_no_integer_is_left_out_and_counted(
    archive: tuple[Path, Path], tmp_path: Path
) -> None:
    """A Parquet file whose step column holds floats is left out, named; rows without a step in
    another are left out and counted; the rest of the archive is shown."""
    directory = tmp_path / "archive"
    shutil.copytree(archive[0], directory)
    source = next(iter(sorted(directory.glob("*.parquet"))))
    floats, nulls = directory / "floats.parquet", directory / "nulls.parquet"
    duckdb.execute(
        f"COPY (SELECT * REPLACE ((step + 0.5)::DOUBLE AS step) FROM '{source}' LIMIT 3) TO '{floats}'"
    )
    duckdb.execute(f"COPY (SELECT * REPLACE (NULL::BIGINT AS step) FROM '{source}' LIMIT 4) TO '{nulls}'")
    with _archive.served(directory) as base, _archive.served(archive[0]) as plain:
        page, reference = get(base, "/"), get(plain, "/")
        assert [b.values for b in page.blocks] == [b.values for b in reference.blocks]
        assert (
            "floats.parquet</code>: not a ParquetSink file: its step column holds DOUBLE, not integers"
            in page.html
        )
        assert "nulls.parquet</code>: 4 records left out: 4 without an id, a step or a split" in page.html


def _reward_line(record: str, prompt: str, group: str, reward: float) -> str:
    line = json.loads(_line(record, 0))
    line["sample"]["metadata"] = {"prompt_id": prompt, "group_uid": group, "reward": reward}
    return json.dumps(line)


def _every_page_answers(base: str, paths: list[str]) -> None:
    """Each of `paths`, and each group and prompt page it links to, answers 200."""
    seen: set[str] = set()
    todo = list(paths)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        page = get(base, path)
        assert page.status == 200, (path, page.status, page.html[-300:])
        todo += [link for link in page.links if link.startswith(("/group?", "/prompt?", "/step?"))]


def test_rewards_at_a_floats_limits_leave_every_page_whole(
    archive: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rewards of 1e308 and -1e308 in one group (their squares and sum pass a float's range), a
    prompt whose every reward is the largest float, and, in a Parquet file of another writer, a
    group holding inf, -inf and NaN: every step, group and prompt page answers, "—" where there is
    no number."""
    largest = 1.7976931348623157e308
    path = tmp_path / "run.jsonl"
    lines = [_reward_line(f"big-{i}", "p-big", "g-big", r) for i, r in enumerate([1e308, -1e308, 1e308])]
    lines += [_reward_line(f"max-{i}", "p-max", "g-max", largest) for i in range(2)]
    path.write_text("\n".join(lines) + "\n")
    with _archive.served(path) as base:
        _every_page_answers(base, ["/step?split=train&step=0"])
        assert get(base, "/group?split=train&step=0&group=g-max").values["spread"] == "0.0000"
    directory = tmp_path / "archive"
    directory.mkdir()
    flagged = "json_extract_string(metadata, '$.group_uid') = 'w2-tools'"
    pick = "(['inf', '-inf', 'nan'])[(row_number() OVER ()) % 3 + 1]::DOUBLE"
    for source in archive[0].glob("*.parquet"):
        target = directory / source.name
        duckdb.execute(
            f"COPY (SELECT * REPLACE (CASE WHEN {flagged} THEN {pick} ELSE reward END AS reward) "
            f"FROM '{source}') TO '{target}'"
        )
    with _archive.served(directory) as base:
        page = get(base, "/group?" + urlencode({"split": "train", "step": 2, "group": "w2-tools"}))
        assert page.status == 200 and page.values["spread"] == "—", page.html[-300:]
        _every_page_answers(base, ["/step?split=train&step=2"])
