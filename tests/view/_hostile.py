"""An archive whose every value that reaches a page is an XSS payload: ids, splits, group and
prompt ids, stop reasons, metadata keys and values, roles, texts, tool names, call ids and
arguments, the archive's folder and a file left out. Written by the real sinks, then its ids
rewritten (a session makes its own; a shared archive may hold any)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio

import asynctrace as at

# Each field's payload names the field in a marker word, so a test can tell every field reached a page.
FIELDS = (
    "id",
    "split",
    "group",
    "prompt",
    "stop",
    "key",
    "value",
    "system",
    "part",
    "text",
    "callid",
    "tool",
    "argkey",
    "argvalue",
    "toolname",
    "result",
    "role",
    "answer",
    "watch",
    "dir",
    "skip",
)


def marker(field: str) -> str:
    return f"XSS{field}MARK"


def payload(field: str, slash: bool = True) -> str:
    """Markup that runs script wherever it is not escaped for its context (text, a quoted or
    unquoted attribute, a URL), and says which field it came from; without `slash` it can name a
    file."""
    script = f'<script>alert("{field}")</script>' if slash else ""
    return (
        f"javascript:alert('{field}');{marker(field)}\"'><img src=x onerror=alert('{field}')>"
        f"{script}<svg onload=alert('{field}')> x onmouseover=alert('{field}') {field}"
    )


PROMPT = payload("prompt")
SPLIT = payload("split")
WATCH = (payload("watch"), PROMPT)


def _messages(i: int) -> list[dict[str, Any]]:
    arguments = json.dumps({payload("argkey"): payload("argvalue")})
    return [
        {"role": "system", "content": payload("system")},
        {"role": "user", "content": [{"type": "text", "text": payload("part")}]},
        {
            "role": "assistant",
            "content": payload("text"),
            "tool_calls": [
                {
                    "id": payload("callid"),
                    "type": "function",
                    "function": {"name": payload("tool"), "arguments": arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": payload("callid"),
            "name": payload("toolname"),
            "content": payload("result"),
        },
        {"role": payload("role"), "content": "a turn with a hostile role"},
        {"role": "assistant", "content": payload("answer") + str(i)},
    ]


def _samples(step: int) -> list[at.Sample]:
    out = []
    for g in range(2):
        for i in range(3):
            n = 4 + i
            out.append(
                at.Sample(
                    messages=_messages(i),
                    metadata={
                        "prompt_id": PROMPT,
                        "group_uid": f"{payload('group')}{g}",
                        "reward": float(i == g),
                        "advantage": float(i == g) - 0.5,
                        "policy_version": step,
                        "stop_reason": payload("stop"),
                        payload("key"): payload("value"),
                    },
                    tokens={"token_ids": list(range(n)), "loss_mask": [1] * n, "logprobs": [-0.5] * n},
                )
            )
    return out


def write(root: Path) -> Path:
    """The archive in a folder named with a payload, with a file it leaves out (named with another)."""
    import pyarrow.parquet as pq

    directory = root / payload("dir", slash=False)

    async def main() -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        async with at.TraceSession(
            "view-hostile", run="r", sinks=[at.ParquetSink(directory, process=False)], health_metrics=False
        ) as session:
            for step in range(3):
                await session.log_samples(_samples(step), step=step, split=SPLIT)
                await session.log_samples(_samples(step), step=step)

    anyio.run(main)
    count = 0
    for path in sorted(directory.glob("*.parquet")):
        table = pq.read_table(path)
        ids = [f"{payload('id')}{count + k}" for k in range(table.num_rows)]
        count += table.num_rows
        column = table.schema.get_field_index("id")
        pq.write_table(table.set_column(column, table.schema.field("id"), [ids]), path)
    (directory / f"{payload('skip', slash=False)}.parquet").write_bytes(b"not a parquet file")
    return directory
