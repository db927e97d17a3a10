"""A record's messages as the viewer reads them: turns, each with its role, its text, the tool calls
it made and the tool result it carries, and where the prompt ends.

Messages come from the archive as stored: any of their fields may be missing or of another type,
so every value is read defensively and shown as text (the pages escape it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "ToolCall",
    "Turn",
    "prompt_length",
    "shared_length",
    "split_messages",
    "turn_of",
    "turns",
    "uses_tools",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an assistant turn: the function's name, its arguments (pretty-printed JSON
    when they parse, else as written) and the call's id."""

    name: str
    arguments: str
    id: str | None


@dataclass(frozen=True, slots=True)
class Turn:
    """One message: its role, its text, the tool calls it made, and for a tool result the tool's
    name and the call it answers."""

    role: str
    text: str
    calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    call_id: str | None = None


def _plain(value: Any) -> str:
    """A value as text: a str as it is, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return repr(value)


def _optional(value: Any) -> str | None:
    return None if value is None else _plain(value)


def _pretty(arguments: Any) -> str:
    """Arguments as indented JSON: a JSON string is parsed first (OpenAI's form); one that does
    not parse is shown as written."""
    if isinstance(arguments, str):
        written: str = arguments
        try:
            arguments = orjson.loads(written)
        except orjson.JSONDecodeError:
            return written
        if not isinstance(arguments, (dict, list)):
            return _plain(arguments)
    try:
        return orjson.dumps(arguments, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return repr(arguments)


def _call(raw: Any) -> ToolCall:
    """A call in OpenAI's form (``{"id", "function": {"name", "arguments"}}``), a flat one
    (``{"name", "arguments"}``) or Anthropic's ``tool_use`` part (``{"id", "name", "input"}``)."""
    if not isinstance(raw, dict):
        return ToolCall(name="?", arguments=_plain(raw), id=None)
    function = raw.get("function")
    where = function if isinstance(function, dict) else raw
    name = where.get("name")
    arguments = where["arguments"] if "arguments" in where else where.get("input", raw.get("input"))
    return ToolCall(
        name="?" if name is None else _plain(name),
        arguments="" if arguments is None else _pretty(arguments),
        id=_optional(raw.get("id")),
    )


def _parts(content: list[Any]) -> tuple[str, list[ToolCall]]:
    """The text and the tool calls of a content given as a list of parts."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    for part in content:
        if not isinstance(part, dict):
            texts.append(_plain(part))
            continue
        kind = part.get("type")
        if kind == "tool_use":
            calls.append(_call(part))
        elif kind == "tool_result":
            inner = part.get("content")
            texts.append(_parts(inner)[0] if isinstance(inner, list) else _plain(inner or ""))
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            texts.append(f"[{_plain(kind) if kind is not None else 'part'}]")
    return "".join(texts), calls


def turn_of(message: Any) -> Turn:
    """One message as a turn; a message that is not a dict is shown as its text (JSON unless a
    str), role "?"."""
    if not isinstance(message, dict):
        return Turn(role="?", text=_plain(message))
    role = message.get("role")
    content = message.get("content")
    calls: list[ToolCall] = []
    if isinstance(content, list):
        text, calls = _parts(content)
    else:
        text = "" if content is None else _plain(content)
    raw_calls = message.get("tool_calls")
    if isinstance(raw_calls, list):
        calls += [_call(c) for c in raw_calls]
    elif isinstance(raw_calls, dict):
        calls.append(_call(raw_calls))
    if isinstance(message.get("function_call"), dict):  # OpenAI's older single call
        calls.append(_call(message["function_call"]))
    return Turn(
        role="?" if role is None else _plain(role),
        text=text,
        calls=tuple(calls),
        name=_optional(message.get("name")),
        call_id=_optional(message.get("tool_call_id")),
    )


def turns(messages: Sequence[Any]) -> list[Turn]:
    return [turn_of(m) for m in messages]


def uses_tools(messages: Sequence[Any]) -> bool:
    """Whether a conversation holds a tool call or a tool's result."""
    return any(t.calls or t.role == "tool" or t.call_id is not None for t in turns(messages))


def prompt_length(messages: Sequence[Any]) -> int:
    """How many messages make the prompt: those before the first assistant turn (all of them
    when the assistant never spoke)."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            return i
    return len(messages)


def shared_length(histories: Sequence[Sequence[Any]]) -> int:
    """How many leading messages every one of these conversations has alike: a group's shared
    prompt. It stops before any member's first assistant turn, so whatever a member did (its
    tool calls included) is shown as that member's."""
    if not histories:
        return 0
    first = histories[0]
    limit = min(prompt_length(h) for h in histories)
    count = 0
    while count < limit and all(h[count] == first[count] for h in histories[1:]):
        count += 1
    return count


def _line(turn: Turn) -> str:
    """A turn as plain text: its text, then each call as ``→ name(arguments)`` on a line of its own."""
    calls = "".join(f"\n→ {c.name}({' '.join(c.arguments.split())})" for c in turn.calls)
    return (turn.text + calls).lstrip("\n")


def split_messages(messages: Sequence[Any]) -> tuple[str, str]:
    """(prompt, completion) as plain text: what the prompt turns say, each after its role, and
    what the turns after them say (a lone assistant answer as it is, several turns each after
    its role), tool calls included."""
    cut = prompt_length(messages)
    head, tail = turns(messages[:cut]), turns(messages[cut:])
    prompt = "\n\n".join(f"{t.role}: {_line(t)}" for t in head)
    if len(tail) == 1 and tail[0].role == "assistant":
        return prompt, _line(tail[0])
    return prompt, "\n\n".join(f"{t.role}: {_line(t)}" for t in tail)
