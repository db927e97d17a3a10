"""The viewer's pages as HTML, built from the archive's answers; every value is escaped here."""

from __future__ import annotations

import difflib
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

from ._model import TRUNCATED, Completion, GroupRow, PromptStep, StepRow
from ._svg import line_chart

__all__ = [
    "error_page",
    "find_page",
    "group_page",
    "layout",
    "loading_page",
    "overview_page",
    "prompt_page",
    "record_page",
    "step_page",
    "url",
]

_WORDS = re.compile(r"\s+|\S+\s*")


def url(path: str, **params: Any) -> str:
    """A view's shareable address: its path and its query, without empty parameters."""
    kept = {k: v for k, v in params.items() if v is not None and v != ""}
    return path + ("?" + urlencode(kept) if kept else "")


def num(value: float | None, digits: int = 4) -> str:
    """A number as every page shows it: fixed decimals, "—" for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"


def share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _cell(key: str, text: str, cls: str = "") -> str:
    extra = f' class="{cls}"' if cls else ""
    return f'<td data-k="{key}"{extra}>{escape(text)}</td>'


def _layout(title: str, body: str, *, archive: str, crumbs: Sequence[tuple[str, str]] = ()) -> str:
    trail = " / ".join(
        ['<a href="/">overview</a>'] + [f'<a href="{escape(h)}">{escape(t)}</a>' for t, h in crumbs]
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{escape(title)} · asynctrace view</title><link rel="stylesheet" href="/static/view.css"></head>
<body><header><a class="brand" href="/">asynctrace view</a><span class="archive">{escape(archive)}</span>
<form class="find" action="/find" method="get"><input name="id" placeholder="record id">
<input name="q" placeholder="text"><button>find</button></form></header>
<nav class="crumbs">{trail}</nav><main><h1>{escape(title)}</h1>
{body}
</main></body></html>"""


# Every view's frame (header, find box, crumbs), for the views kept in modules of their own.
layout = _layout


def loading_page(seconds: float, *, archive: str) -> str:
    body = (
        f'<p class="loading">Indexing the archive ({seconds:.0f} s so far): its first open reads every '
        "record's metadata once; later starts read the kept index. This page reloads itself.</p>"
    )
    page = _layout("Indexing…", body, archive=archive)
    return page.replace("<head>", '<head><meta http-equiv="refresh" content="1">', 1)


def error_page(message: str, *, archive: str, title: str = "Not found") -> str:
    return _layout(title, f'<p class="error">{escape(message)}</p>', archive=archive)


def overview_page(
    rows: Sequence[StepRow],
    watched: Sequence[tuple[str, int, int]],
    frequent: Sequence[tuple[str, int, int]],
    *,
    archive: str,
    total: int,
    skipped: dict[str, str] | None = None,
) -> str:
    parts = [f'<p class="muted">{total:,} records, {len(rows):,} steps. Click a step to open its groups.</p>']
    if skipped:
        items = "".join(f"<li><code>{escape(f)}</code>: {escape(why)}</li>" for f, why in skipped.items())
        parts.append(f'<div class="skipped"><p>Files left out:</p><ul>{items}</ul></div>')
    for split in sorted({r.split for r in rows}):
        mine = [r for r in rows if r.split == split]

        def link(step: int, split: str = split) -> str:
            return url("/step", split=split, step=step)

        zero = [(r.step, r.zero_signal / r.groups if r.groups else None) for r in mine]
        parts.append(f'<h2>split <code>{escape(split)}</code></h2><div class="charts">')
        parts.append(
            line_chart(
                [
                    ("mean", [(r.step, r.reward_mean) for r in mine]),
                    ("std", [(r.step, r.reward_std) for r in mine]),
                ],
                title="reward",
                link=link,
            )
        )
        parts.append(
            line_chart(
                [("zero-signal groups", zero), ("truncated", [(r.step, r.truncated) for r in mine])],
                title="share of zero-signal groups, of truncated completions",
                link=link,
            )
        )
        parts.append(
            line_chart(
                [("mean", [(r.step, r.length_mean) for r in mine])], title="response length", link=link
            )
        )
        parts.append(
            line_chart(
                [("mean", [(r.step, r.lag_mean) for r in mine])], title="policy-version lag", link=link
            )
        )
        parts.append("</div>")
        parts.append(
            '<table class="steps"><thead><tr><th>step</th><th>samples</th><th>reward mean</th>'
            "<th>reward std</th><th>groups</th><th>zero-signal groups</th><th>mean group spread</th>"
            "<th>truncated</th><th>response length</th><th>lag mean</th><th>lag max</th></tr></thead><tbody>"
        )
        for r in mine:
            parts.append(
                f'<tr data-split="{escape(r.split)}" data-step="{r.step}">'
                f'<td data-k="step"><a href="{escape(link(r.step))}">{r.step}</a></td>'
                + _cell("samples", str(r.samples))
                + _cell("reward_mean", num(r.reward_mean))
                + _cell("reward_std", num(r.reward_std))
                + _cell("groups", str(r.groups))
                + _cell("zero_signal", str(r.zero_signal), "warn" if r.zero_signal else "")
                + _cell("mean_spread", num(r.mean_spread))
                + _cell("truncated", share(r.truncated))
                + _cell("length_mean", num(r.length_mean, 1))
                + _cell("lag_mean", num(r.lag_mean, 2))
                + _cell("lag_max", "—" if r.lag_max is None else str(r.lag_max))
                + "</tr>"
            )
        parts.append("</tbody></table>")
    parts.append(_prompt_list("Watched prompts", watched, "watched"))
    parts.append(_prompt_list("Prompts seen at the most steps", frequent, "frequent"))
    return _layout("Run overview", "".join(parts), archive=archive)


def _prompt_list(title: str, prompts: Sequence[tuple[str, int, int]], cls: str) -> str:
    if not prompts:
        return ""
    items = "".join(
        f'<li><a href="{escape(url("/prompt", id=p))}">{escape(p)}</a> '
        f'<span class="muted">{steps} steps, {samples} samples</span></li>'
        if steps
        else f'<li>{escape(p)} <span class="muted">not in the archive</span></li>'
        for p, steps, samples in prompts
    )
    return f'<h2>{escape(title)}</h2><ul class="prompts {cls}">{items}</ul>'


def _clip(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def step_page(
    split: str,
    step: int,
    order: str,
    groups: Sequence[GroupRow],
    prompts: dict[str, str],
    *,
    archive: str,
    limit: int,
) -> str:
    here = url("/step", split=split, step=step)
    orders = " · ".join(
        f'<a href="{escape(url("/step", split=split, step=step, order=o))}"'
        f"{' class=on' if o == order else ''}>{label}</a>"
        for o, label in (
            ("spread", "spread, highest first"),
            ("-spread", "spread, lowest first"),
            ("mean", "mean, highest first"),
            ("-mean", "mean, lowest first"),
        )
    )
    zero = sum(1 for g in groups if g.spread == 0)
    rows = []
    for g in groups[:limit]:
        href = url("/group", split=split, step=step, group=g.group)
        flat = g.spread == 0
        rows.append(
            f'<tr class="{"zero" if flat else ""}" data-group="{escape(g.group)}">'
            f'<td data-k="group"><a href="{escape(href)}">{escape(g.group)}</a></td>'
            + (
                f'<td data-k="prompt_id"><a href="{escape(url("/prompt", id=g.prompt, split=split))}">'
                f"{escape(g.prompt)}</a></td>"
                if g.prompt
                else _cell("prompt_id", "—")
            )
            + _cell("samples", str(g.samples))
            + _cell("reward_mean", num(g.reward_mean))
            + _cell("spread", num(g.spread))
            + _cell("truncated", str(g.truncated))
            + f'<td data-k="signal">{"<span class=badge>zero spread</span>" if flat else ""}</td>'
            + _cell("text", _clip(prompts.get(g.first_id, "")), "text")
            + "</tr>"
        )
    more = (
        f'<p><a href="{escape(url("/step", split=split, step=step, order=order, limit=len(groups)))}">'
        f"show all {len(groups)} groups</a></p>"
        if len(groups) > limit
        else ""
    )
    body = (
        f'<p class="muted">{len(groups)} groups, {zero} with zero reward spread (no signal). '
        f"Rank by: {orders}</p>"
        '<table class="groups"><thead><tr><th>group</th><th>prompt id</th><th>samples</th>'
        "<th>reward mean</th><th>spread</th><th>truncated</th><th></th><th>prompt</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{more}"
    )
    return _layout(f"Step {step} ({split}): groups", body, archive=archive, crumbs=[(f"step {step}", here)])


def _completion_card(c: Completion, *, show_step: bool = False) -> str:
    facts = [
        ("reward", num(c.reward)),
        ("advantage", num(c.advantage)),
        ("stop reason", c.stop_reason or "—"),
        ("length", "—" if c.length is None else str(c.length)),
        ("policy version", "—" if c.policy_version is None else str(c.policy_version)),
    ]
    if show_step:
        facts.insert(0, ("step", str(c.step)))
    keys = {
        "step": "step",
        "reward": "reward",
        "advantage": "advantage",
        "stop reason": "stop_reason",
        "length": "length",
        "policy version": "policy_version",
    }
    dl = "".join(f'<dt>{escape(k)}</dt><dd data-k="{keys[k]}">{escape(v)}</dd>' for k, v in facts)
    links = [f'<a href="{escape(url("/record", id=c.id))}">record</a>']
    if c.has_tokens:
        links.append(f'<a class="tokens-link" href="{escape(url("/tokens", id=c.id))}">tokens</a>')
    truncated = " truncated" if c.stop_reason in TRUNCATED else ""
    return (
        f'<article class="completion{truncated}" data-id="{escape(c.id)}">'
        f"<header><code>{escape(c.id)}</code> {' · '.join(links)}</header><dl>{dl}</dl>"
        f'<pre class="text">{escape(c.text)}</pre></article>'
    )


def group_page(split: str, step: int, group: str, completions: Sequence[Completion], *, archive: str) -> str:
    rewards = [c.reward for c in completions if c.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if mean is not None else None
    prompt_id = completions[0].prompt_id if completions else None
    banner = (
        '<p class="badge zero-banner">zero spread: every completion got the same reward, '
        "so this group gives no learning signal</p>"
        if spread == 0
        else ""
    )
    history = (
        f'<a class="history" href="{escape(url("/prompt", id=prompt_id, split=split))}">'
        f"history of prompt {escape(prompt_id)}</a>"
        if prompt_id
        else ""
    )
    cards = "".join(_completion_card(c) for c in completions)
    body = (
        f'<p class="summary"><span data-k="samples">{len(completions)}</span> completions · reward mean '
        f'<span data-k="reward_mean">{num(mean)}</span> · spread <span data-k="spread">{num(spread)}</span>'
        f" · {history}</p>{banner}"
        f'<h2>Prompt</h2><pre class="prompt">{escape(completions[0].prompt if completions else "")}</pre>'
        f'<h2>Completions</h2><div class="side-by-side">{cards}</div>'
    )
    crumbs = [(f"step {step}", url("/step", split=split, step=step)), (f"group {group}", "")]
    crumbs[-1] = (crumbs[-1][0], url("/group", split=split, step=step, group=group))
    return _layout(f"Group {group}, step {step} ({split})", body, archive=archive, crumbs=crumbs)


def word_diff(old: str, new: str) -> str:
    """`new` against `old`, word by word: removed words struck out, added ones marked.

    Words are compared without the whitespace after them (each word carries its own, so the
    matcher sees no run of popular whitespace tokens: that keeps it fast on long texts)."""
    a, b = _WORDS.findall(old), _WORDS.findall(new)
    matcher = difflib.SequenceMatcher(None, [w.rstrip() for w in a], [w.rstrip() for w in b])
    out = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            out.append(escape("".join(b[j1:j2])))
            continue
        removed, added = "".join(a[i1:i2]), "".join(b[j1:j2])
        if removed.strip():
            out.append(f"<del>{escape(removed.rstrip())}</del>")
        if added.strip():
            out.append(f"<ins>{escape(added.rstrip())}</ins>")
        out.append(escape((added or removed)[len((added or removed).rstrip()) :]))
    return "".join(out)


def _reward(c: Completion) -> float:
    return -math.inf if c.reward is None else c.reward


def _by_step(completions: Iterable[Completion]) -> dict[int, list[Completion]]:
    out: dict[int, list[Completion]] = {}
    for c in completions:
        out.setdefault(c.step, []).append(c)
    return out


def prompt_page(
    prompt: str,
    split: str,
    splits: Sequence[str],
    steps: Sequence[PromptStep],
    completions: Sequence[Completion],
    *,
    archive: str,
    diffs: int = 20,
) -> str:
    here = url("/prompt", id=prompt, split=split)
    other = " · ".join(
        f'<a href="{escape(url("/prompt", id=prompt, split=s))}">{escape(s)}</a>'
        for s in splits
        if s != split
    )
    chart = line_chart(
        [("mean", [(s.step, s.reward_mean) for s in steps])],
        title="reward over steps (dots: every completion)",
        link=lambda x: url(
            "/group", split=split, step=x, group=next(s.group for s in steps if s.step == x) or ""
        ),
        dots=[(c.step, c.reward) for c in completions if c.reward is not None],
    )
    table = "".join(
        f'<tr data-step="{s.step}"><td data-k="step"><a href="'
        f'{escape(url("/group", split=split, step=s.step, group=s.group or ""))}">{s.step}</a></td>'
        + _cell("samples", str(s.samples))
        + _cell("reward_mean", num(s.reward_mean))
        + _cell("reward_min", num(s.reward_min))
        + _cell("reward_max", num(s.reward_max))
        + _cell("spread", num(s.spread))
        + _cell("versions", s.versions)
        + "</tr>"
        for s in steps
    )
    versions: dict[int | None, list[Completion]] = {}
    for c in completions:
        versions.setdefault(c.policy_version, []).append(c)
    blocks = []
    for version, items in versions.items():
        # The best and the worst of each version: the archive read their texts.
        top, bottom = max(items, key=_reward), min(items, key=_reward)
        shown = [top] if top is bottom else [top, bottom]
        rewards = [c.reward for c in items if c.reward is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        label = "unknown" if version is None else str(version)
        blocks.append(
            f'<section class="version" data-version="{escape(label)}"><h3>policy version {escape(label)} '
            f'<span class="muted">{len(items)} completions at {len({c.step for c in items})} steps, '
            f"reward mean {num(mean)}; the best and the worst:</span></h3>"
            f'<div class="side-by-side">{"".join(_completion_card(c, show_step=True) for c in shown)}</div>'
            "</section>"
        )
    # Consecutive steps compared by their best completion: where the text changed, and how.
    best = [(step, max(items, key=_reward)) for step, items in sorted(_by_step(completions).items())]
    pairs = list(itertools.pairwise(best))[-diffs:]
    diff_blocks = "".join(
        f'<section class="diff" data-from="{a[1].id}" data-to="{b[1].id}"><h3>step {a[0]} → step {b[0]} '
        f'<span class="muted">reward {num(a[1].reward)} → {num(b[1].reward)}</span></h3>'
        f'<pre class="text">{word_diff(a[1].text, b[1].text)}</pre></section>'
        for a, b in reversed(pairs)
    )
    body = (
        f'<p class="muted">{sum(s.samples for s in steps)} completions at {len(steps)} steps'
        f"{' · other splits: ' + other if other else ''}</p>"
        f'<pre class="prompt">{escape(completions[0].prompt if completions else "")}</pre>{chart}'
        '<table class="history"><thead><tr><th>step</th><th>samples</th><th>reward mean</th><th>min</th>'
        f"<th>max</th><th>spread</th><th>policy versions</th></tr></thead><tbody>{table}</tbody></table>"
        f"<h2>Completions by policy version</h2>{''.join(blocks)}"
        f"<h2>From one step to the next</h2><p class=muted>Each step's best completion against the "
        f"previous step's: <del>removed</del>, <ins>added</ins>.</p>{diff_blocks}"
    )
    return _layout(f"Prompt {prompt} ({split})", body, archive=archive, crumbs=[(f"prompt {prompt}", here)])


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else repr(content)


def record_page(c: Completion, *, archive: str) -> str:
    links = []
    if c.group is not None:
        links.append(
            f'<a href="{escape(url("/group", split=c.split, step=c.step, group=c.group))}">its group</a>'
        )
    if c.prompt_id is not None:
        links.append(
            f'<a href="{escape(url("/prompt", id=c.prompt_id, split=c.split))}">its prompt history</a>'
        )
    if c.has_tokens:
        links.append(f'<a href="{escape(url("/tokens", id=c.id))}">its tokens</a>')
    meta = "".join(
        f"<tr><th>{escape(str(k))}</th><td>{escape(v if isinstance(v, str) else repr(v))}</td></tr>"
        for k, v in c.metadata.items()
    )
    messages = "".join(
        f'<div class="message"><b>{escape(str(m.get("role", "?")))}</b><pre class="text">'
        f"{escape(_message_text(m))}</pre></div>"
        for m in c.messages
        if isinstance(m, dict)
    )
    body = (
        f"<p>step {c.step} · split {escape(c.split)} · {' · '.join(links)}</p>"
        f"{_completion_card(c, show_step=True)}<h2>Messages</h2>{messages}"
        f'<h2>Metadata</h2><table class="meta">{meta}</table>'
    )
    return _layout(
        f"Record {c.id}", body, archive=archive, crumbs=[(f"record {c.id}", url("/record", id=c.id))]
    )


def find_page(
    found: Sequence[Completion] | None,
    *,
    archive: str,
    query: dict[str, str],
    splits: Sequence[str],
    limit: int,
) -> str:
    options = "".join(
        f'<option value="{escape(s)}"{" selected" if query.get("split") == s else ""}>{escape(s)}</option>'
        for s in ["", *splits]
    )
    form = (
        '<form class="search" action="/find" method="get">'
        f'<label>record id <input name="id" value="{escape(query.get("id", ""))}"></label>'
        f'<label>text <input name="q" value="{escape(query.get("q", ""))}"></label>'
        f'<label>reward from <input name="low" size="6" value="{escape(query.get("low", ""))}"></label>'
        f'<label>to <input name="high" size="6" value="{escape(query.get("high", ""))}"></label>'
        f'<label>split <select name="split">{options}</select></label><button>find</button></form>'
    )
    if found is None:
        return _layout("Find", form, archive=archive)
    rows = "".join(
        f'<tr data-id="{escape(c.id)}">'
        f'<td><a href="{escape(url("/record", id=c.id))}">{escape(c.id)}</a></td>'
        f'<td data-k="step">{c.step}</td>'
        + _cell("split", c.split)
        + _cell("reward", num(c.reward))
        + (
            f'<td><a href="{escape(url("/group", split=c.split, step=c.step, group=c.group))}">'
            f"{escape(c.group)}</a></td>"
            if c.group is not None
            else "<td>—</td>"
        )
        + _cell("text", _clip(c.text), "text")
        + "</tr>"
        for c in found
    )
    note = f"{len(found)} records" + (f" (the first {limit})" if len(found) >= limit else "")
    body = (
        f'{form}<p class="muted">{note}</p><table class="found"><thead><tr><th>id</th><th>step</th>'
        f"<th>split</th><th>reward</th><th>group</th><th>completion</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    return _layout("Find", body, archive=archive)
