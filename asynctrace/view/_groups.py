"""The pages of one group (its members side by side) and of one prompt across steps."""

from __future__ import annotations

import difflib
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from html import escape

from ._cards import completion_card, turns_html
from ._html import cell, layout, num, url
from ._model import HISTORY_DIFFS, HISTORY_VERSIONS, TRUNCATED, Completion, PromptStep, reward_stats
from ._svg import Member, line_chart, member_strip
from ._turns import shared_length

__all__ = ["group_page", "prompt_page", "word_diff"]

_WORDS = re.compile(r"\s+|\S+\s*")


def _strip(completions: Sequence[Completion]) -> str:
    members = [
        Member(
            anchor=f"m{i}",
            label=c.id,
            reward=c.reward,
            advantage=c.advantage,
            length=c.length,
            stop_reason=c.stop_reason,
            truncated=c.stop_reason in TRUNCATED,
        )
        for i, c in enumerate(completions)
    ]
    legend = (
        '<p class="legend muted">Each member, best reward first (click one for its card): its reward '
        '(<span class="sw gain"></span> advantage above zero, <span class="sw loss"></span> below, '
        '<span class="sw flat"></span> zero), its length in grey below, '
        '<span class="sw cut"></span> truncated; hover for the numbers.</p>'
    )
    return f'<div class="strip">{member_strip(members)}{legend}</div>'


def group_page(split: str, step: int, group: str, completions: Sequence[Completion], *, archive: str) -> str:
    mean, spread = reward_stats([c.reward for c in completions if c.reward is not None])
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
    truncated = sum(1 for c in completions if c.stop_reason in TRUNCATED)
    # What every member was given, shown once; each card shows what its member did after it.
    shared = shared_length([c.messages for c in completions])
    prompt = turns_html(completions[0].messages[:shared]) if completions else ""
    cards = "".join(completion_card(c, skip=shared, anchor=f"m{i}") for i, c in enumerate(completions))
    body = (
        f'<p class="summary"><span data-k="samples">{len(completions)}</span> completions · reward mean '
        f'<span data-k="reward_mean">{num(mean)}</span> · spread <span data-k="spread">{num(spread)}</span>'
        f' · <span data-k="truncated">{truncated}</span> truncated · {history}</p>'
        f"{banner}{_strip(completions)}"
        f'<h2>Prompt <span class="muted">shared by every member</span></h2>'
        f'<section class="prompt shared">{prompt or "<p class=muted>none shared</p>"}</section>'
        f'<h2>Members <span class="muted">what each did after the prompt</span></h2>'
        f'<div class="members">{cards}</div>'
    )
    crumbs = [
        (f"step {step}", url("/step", split=split, step=step)),
        (f"group {group}", url("/group", split=split, step=step, group=group)),
    ]
    return layout(f"Group {group}, step {step} ({split})", body, archive=archive, crumbs=crumbs)


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


def _group_links(split: str, s: PromptStep) -> str:
    return " ".join(
        f'<a class="group" href="{escape(url("/group", split=split, step=s.step, group=g))}">{escape(g)}</a>'
        for g in s.groups
    )


def prompt_page(
    prompt: str,
    split: str,
    splits: Sequence[str],
    steps: Sequence[PromptStep],
    completions: Sequence[Completion],
    *,
    archive: str,
) -> str:
    here = url("/prompt", id=prompt, split=split)
    other = " · ".join(
        f'<a href="{escape(url("/prompt", id=prompt, split=s))}">{escape(s)}</a>'
        for s in splits
        if s != split
    )
    first_group = {s.step: s.groups[0] for s in steps if s.groups}
    chart = line_chart(
        [("mean", [(s.step, s.reward_mean) for s in steps])],
        title="reward over steps (dots: every completion)",
        link=lambda x: (
            url("/group", split=split, step=x, group=first_group[x])
            if x in first_group
            else url("/step", split=split, step=x)
        ),
        dots=[(c.step, c.reward) for c in completions if c.reward is not None],
    )
    table = "".join(
        f'<tr data-step="{s.step}"><td data-k="step">'
        f'<a href="{escape(url("/step", split=split, step=s.step))}">{s.step}</a></td>'
        f'<td class="groups">{_group_links(split, s) or "—"}</td>'
        + cell("samples", str(s.samples))
        + cell("reward_mean", num(s.reward_mean))
        + cell("reward_min", num(s.reward_min))
        + cell("reward_max", num(s.reward_max))
        + cell("spread", num(s.spread))
        + cell("versions", s.versions)
        + "</tr>"
        for s in steps
    )
    versions: dict[int | None, list[Completion]] = {}
    for c in completions:
        versions.setdefault(c.policy_version, []).append(c)
    blocks = []
    older = []
    for k, (version, items) in enumerate(versions.items()):
        mean = reward_stats([c.reward for c in items if c.reward is not None]).mean
        label = "unknown" if version is None else str(version)
        counts = f"{len(items)} completions at {len({c.step for c in items})} steps, reward mean {num(mean)}"
        if k >= HISTORY_VERSIONS:
            # Only the latest versions' texts are read (`HISTORY_VERSIONS`): older ones are counted.
            older.append(f"<li>policy version {escape(label)}: {counts}</li>")
            continue
        # The best and the worst of each version: the archive read their texts.
        top, bottom = max(items, key=_reward), min(items, key=_reward)
        shown = [top] if top is bottom else [top, bottom]
        blocks.append(
            f'<section class="version" data-version="{escape(label)}"><h3>policy version {escape(label)} '
            f'<span class="muted">{counts}; the best and the worst:</span></h3>'
            f'<div class="side-by-side">{"".join(completion_card(c, show_step=True) for c in shown)}</div>'
            "</section>"
        )
    if older:
        blocks.append(
            f'<section class="older-versions"><h3>{len(older)} older policy versions '
            '<span class="muted">(their completions are in the table above, a click away)</span></h3>'
            f"<ul>{''.join(older)}</ul></section>"
        )
    # Consecutive steps compared by their best completion: where the text changed, and how.
    best = [(step, max(items, key=_reward)) for step, items in sorted(_by_step(completions).items())]
    pairs = list(itertools.pairwise(best))[-HISTORY_DIFFS:]
    diff_blocks = "".join(
        f'<section class="diff" data-from="{escape(a[1].id)}" data-to="{escape(b[1].id)}">'
        f'<h3>step {a[0]} → step {b[0]} <span class="muted">reward {num(a[1].reward)} → '
        f'{num(b[1].reward)}</span></h3><pre class="text">{word_diff(a[1].text, b[1].text)}</pre></section>'
        for a, b in reversed(pairs)
    )
    shown_prompt = next((c for c in completions if c.loaded), None)
    prompt_turns = turns_html(shown_prompt.messages[: shown_prompt.prompt_turns]) if shown_prompt else ""
    body = (
        f'<p class="muted">{sum(s.samples for s in steps)} completions at {len(steps)} steps'
        f"{' · other splits: ' + other if other else ''}</p>"
        f'<section class="prompt">{prompt_turns}</section>{chart}'
        '<table class="history"><thead><tr><th>step</th><th>groups</th><th>samples</th><th>reward mean</th>'
        "<th>min</th><th>max</th><th>spread</th><th>policy versions</th></tr></thead>"
        f"<tbody>{table}</tbody></table>"
        f"<h2>Completions by policy version</h2>{''.join(blocks)}"
        f"<h2>From one step to the next</h2><p class=muted>Each step's best completion against the "
        f"previous step's: <del>removed</del>, <ins>added</ins>.</p>{diff_blocks}"
    )
    return layout(f"Prompt {prompt} ({split})", body, archive=archive, crumbs=[(f"prompt {prompt}", here)])
