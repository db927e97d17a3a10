"""What Trackio's Traces tab shows of a trace's tokens, tool operations and preview.

Traces are logged through `TrackioSink` into real Trackio storage, read back with the call the
dashboard's API makes (`SQLiteStorage.get_traces`), and given to Trackio's own frontend code:
`lib/traceUtils.js` run by Node where it is installed, and always the transcription below,
which a test holds to the installed files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import asynctrace as at
from asynctrace.sinks._trackio_spans import GENERATION_SPAN_ID
from tests._util import read_traces

_UTILS = resources.files("trackio").joinpath("frontend/src/lib/traceUtils.js")
_PAGE = resources.files("trackio").joinpath("frontend/src/pages/Traces.svelte")


def _number(value: Any) -> float | None:
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None


def _first(*values: Any) -> float | None:
    return next((n for n in map(_number, values) if n is not None), None)


def _tool_call_count(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("tool_calls") or []) + bool(m.get("function_call")) for m in messages)


def _shown(trace: dict[str, Any]) -> dict[str, Any]:
    """The Traces tab's row and summary: `normalizeTrace` (Traces.svelte) and `traceSummary`,
    `spanUsage`, `traceSpans` (traceUtils.js), for the fields these tests read."""
    messages = trace["messages"]
    spans = trace["spans"] or [None] * _tool_call_count(messages)
    total = inputs = outputs = 0.0
    has_usage = False
    for span in spans:
        usage = (span or {}).get("usage") or {}
        i = _first(usage.get("input_tokens"), usage.get("prompt_tokens"), (span or {}).get("input_tokens"))
        o = _first(
            usage.get("output_tokens"), usage.get("completion_tokens"), (span or {}).get("output_tokens")
        )
        t = _first(usage.get("total_tokens"), (span or {}).get("total_tokens"))
        if t is None and (i is not None or o is not None):
            t = (i or 0) + (o or 0)
        if t is not None:
            inputs, outputs, total, has_usage = inputs + (i or 0), outputs + (o or 0), total + t, True
    assistant = next((m for m in messages if m.get("role") == "assistant"), None)
    content = assistant.get("content") if assistant else None
    return {
        "totalTokens": total if has_usage else None,
        "inputTokens": inputs if has_usage else None,
        "outputTokens": outputs if has_usage else None,
        "spanCount": len(spans),
        "preview": (content if isinstance(content, str) else "") or "(no assistant response)",
    }


def test_the_transcription_follows_the_installed_dashboard() -> None:
    """The rules `_shown` transcribes are those of the installed Trackio's frontend sources."""
    utils, page = _UTILS.read_text(), _PAGE.read_text()
    for line in (
        "if (Array.isArray(trace?.spans) && trace.spans.length) return trace.spans;",
        "return messageToolSpans(trace?.messages || []);",
        "usage.input_tokens,\n    usage.prompt_tokens,\n    span?.input_tokens,",
        "usage.output_tokens,\n    usage.completion_tokens,\n    span?.output_tokens,",
        "const suppliedTotal = firstNumber(usage.total_tokens, span?.total_tokens);",
        "spanCount: spans.length,",
    ):
        assert line in utils, line
    assert 'const firstAssistant = messages.find((message) => message?.role === "assistant");' in page
    assert 'preview: textFromContent(firstAssistant?.content) || "(no assistant response)",' in page
    assert "{formatTokens(trace.summary.totalTokens)}" in page


_CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "6*7"}'}}
SAMPLES = [
    # An RL rollout as the adapters give it: token counts in the metadata.
    at.Sample(
        messages=[{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "42"}],
        metadata={"uid": "counts", "prompt_len": 11, "response_len": 3},
    ),
    # A tool-calling rollout: its first assistant turn is the call, the last the answer.
    at.Sample(
        messages=[
            {"role": "user", "content": "6*7?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {"role": "assistant", "content": "It is 42."},
        ],
        metadata={"uid": "tools", "prompt_len": 5, "response_len": 9},
    ),
    # Token ids kept with the sample, no counts.
    at.Sample(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        metadata={"uid": "ids"},
        tokens={"token_ids": [1, 2, 3, 4, 5, 6, 7]},
    ),
    # Spans of the sample's own are kept as they are.
    at.Sample(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        metadata={"uid": "own", "prompt_len": 1, "response_len": 1},
        spans=[{"id": "s", "name": "mine", "kind": "span"}],
    ),
    # Nothing to count.
    at.Sample(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        metadata={"uid": "none"},
    ),
]


@pytest.fixture
def stored(project: str) -> dict[str, dict[str, Any]]:
    """The traces of SAMPLES as Trackio's storage returns them to the dashboard, by uid."""
    with at.TraceSession(project, run="r", sinks=[at.TrackioSink(process=False)]) as session:
        session.log_samples(SAMPLES, step=0)
    return {t["metadata"]["uid"]: t for t in read_traces(project, "r")}


def test_token_counts_show_in_the_traces_tab(stored: dict[str, dict[str, Any]]) -> None:
    """Prompt and response lengths show as input, output and total tokens; token ids as a total;
    a tool-calling trace keeps its tool operation; a sample's own spans are left alone."""
    shown = {uid: _shown(t) for uid, t in stored.items()}
    assert (shown["counts"]["inputTokens"], shown["counts"]["outputTokens"]) == (11, 3)
    assert shown["counts"]["totalTokens"] == 14
    assert shown["tools"]["totalTokens"] == 14 and shown["tools"]["spanCount"] == 2
    tool = stored["tools"]["spans"][1]
    assert (tool["name"], tool["input"], tool["output"]) == ("calc", {"x": "6*7"}, 42)
    assert shown["ids"]["totalTokens"] == 7
    assert stored["own"]["spans"] == [{"id": "s", "name": "mine", "kind": "span"}]
    assert shown["own"]["totalTokens"] is None and shown["none"]["totalTokens"] is None
    assert stored["none"]["spans"] == []
    assert stored["counts"]["spans"][0]["id"] == GENERATION_SPAN_ID
    assert stored["counts"]["messages"] == [m for m in SAMPLES[0].messages]


def test_the_preview_is_the_first_assistant_turn(stored: dict[str, dict[str, Any]]) -> None:
    """Trackio previews the first assistant message's text: a plain answer shows; a trace whose
    first assistant turn is only a tool call shows no answer, its messages left as logged."""
    assert _shown(stored["counts"])["preview"] == "42"
    assert _shown(stored["tools"])["preview"] == "(no assistant response)"
    assert stored["tools"]["messages"] == SAMPLES[1].messages


@pytest.mark.skipif(shutil.which("node") is None, reason="runs Trackio's frontend code in Node")
def test_trackios_own_code_shows_the_same(stored: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Trackio's `traceSummary` itself, run in Node on the stored traces, gives the transcription's
    tokens and operations."""
    module = tmp_path / "traceUtils.mjs"
    module.write_text(_UTILS.read_text())
    (tmp_path / "traces.json").write_text(json.dumps(stored))
    script = (
        f"import {{ traceSummary }} from {json.dumps(module.as_uri())};\n"
        "import { readFileSync } from 'node:fs';\n"
        f"const traces = JSON.parse(readFileSync({json.dumps(str(tmp_path / 'traces.json'))}, 'utf8'));\n"
        "const out = {};\n"
        "for (const [uid, t] of Object.entries(traces)) out[uid] = traceSummary(t);\n"
        "console.log(JSON.stringify(out));\n"
    )
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60, check=True
    )
    summaries = json.loads(done.stdout)
    for uid, trace in stored.items():
        mine = _shown(trace)
        theirs = summaries[uid]
        assert [theirs[k] for k in ("totalTokens", "inputTokens", "outputTokens", "spanCount")] == [
            mine[k] for k in ("totalTokens", "inputTokens", "outputTokens", "spanCount")
        ], uid
    assert summaries["counts"]["totalTokens"] == 14
