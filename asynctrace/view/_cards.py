"""A completion as the pages show it: its numbers, and its turns as they happened (each turn's role,
text, tool calls with their arguments, and tool results)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from ._html import num, url
from ._model import TRUNCATED, Completion
from ._turns import Turn, turns

__all__ = ["completion_card", "turns_html"]

# Roles with a colour of their own in view.css; any other role is shown as written, in grey.
_ROLES = frozenset(("system", "user", "assistant", "tool", "developer", "function", "ipython"))
_KEYS = {
    "step": "step",
    "reward": "reward",
    "advantage": "advantage",
    "stop reason": "stop_reason",
    "length": "length",
    "policy version": "policy_version",
}


def _turn(turn: Turn, position: int) -> str:
    role = turn.role if turn.role in _ROLES else "other"
    about = [turn.name] if turn.name is not None else []
    if turn.call_id is not None:
        about.append(f"answers {turn.call_id}")
    head = f'<span class="role">{escape(turn.role)}</span>' + (
        f' <span class="muted about">{escape(" · ".join(about))}</span>' if about else ""
    )
    calls = "".join(
        '<div class="call"><span class="muted">calls</span> '
        f'<code class="fn">{escape(c.name)}</code>'
        + (f' <span class="muted">{escape(c.id)}</span>' if c.id is not None else "")
        + (f'<pre class="args">{escape(c.arguments)}</pre>' if c.arguments else "")
        + "</div>"
        for c in turn.calls
    )
    text = f'<pre class="text">{escape(turn.text)}</pre>' if turn.text or not turn.calls else ""
    return f'<li class="turn r-{role}" data-turn="{position}">{head}{text}{calls}</li>'


def turns_html(messages: Sequence[object], first: int = 0) -> str:
    """The turns of `messages` from the `first`-th on, each marked with its position in the record."""
    shown = turns(messages[first:])
    if not shown:
        return ""
    return '<ol class="turns">' + "".join(_turn(t, first + i) for i, t in enumerate(shown)) + "</ol>"


def completion_card(
    c: Completion, *, skip: int | None = None, show_step: bool = False, anchor: str = "", text: bool = True
) -> str:
    """A completion's numbers and its turns after the first `skip` messages (by default its
    prompt; a group page passes the group's shared prompt). `anchor` is the card's id in the page;
    without `text` the card shows its numbers only."""
    facts = [
        ("reward", num(c.reward)),
        ("advantage", num(c.advantage)),
        ("stop reason", c.stop_reason or "—"),
        ("length", "—" if c.length is None else str(c.length)),
        ("policy version", "—" if c.policy_version is None else str(c.policy_version)),
    ]
    if show_step:
        facts.insert(0, ("step", str(c.step)))
    dl = "".join(f'<dt>{escape(k)}</dt><dd data-k="{_KEYS[k]}">{escape(v)}</dd>' for k, v in facts)
    links = [f'<a href="{escape(url("/record", id=c.id))}">record</a>']
    if c.has_tokens:
        links.append(f'<a class="tokens-link" href="{escape(url("/tokens", id=c.id))}">tokens</a>')
    classes = ["completion"]
    if c.stop_reason in TRUNCATED:
        classes.append("truncated")
    if c.advantage is not None and c.advantage != 0:
        classes.append("gain" if c.advantage > 0 else "loss")
    ident = f' id="{escape(anchor)}"' if anchor else ""
    body = turns_html(c.messages, c.prompt_turns if skip is None else skip) if text else ""
    return (
        f'<article class="{" ".join(classes)}"{ident} data-id="{escape(c.id)}">'
        f"<header><code>{escape(c.id)}</code> {' · '.join(links)}</header><dl>{dl}</dl>{body}</article>"
    )
