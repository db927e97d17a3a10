"""The viewer's pages as HTML, built from the archive's answers: the overview, a step's groups, a
record, find, and the pages that say the archive is not ready; every value is escaped here."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from html import escape

from ._cards import completion_card, turns_html
from ._html import cell, clip, layout, num, share, url
from ._model import Completion, GroupRow, StepFilter, StepRow, split_order
from ._svg import line_chart

__all__ = [
    "PAGE_STEPS",
    "error_page",
    "find_page",
    "loading_page",
    "names_page",
    "overview_page",
    "record_page",
    "step_page",
]


# Steps in one page of the overview's tables, the latest first: a table of every step was 1.2 MB
# of HTML at 2,441 steps. The charts above it keep every step.
PAGE_STEPS = 100


def loading_page(seconds: float, *, archive: str) -> str:
    body = (
        f'<p class="loading">Indexing the archive ({seconds:.0f} s so far): its first open reads every '
        "record's metadata once; later starts read the kept index. This page reloads itself.</p>"
    )
    return layout("Indexing…", body, archive=archive, refresh=True)


def error_page(message: str, *, archive: str, title: str = "Not found") -> str:
    return layout(title, f'<p class="error">{escape(message)}</p>', archive=archive)


def _left_out(title: str, files: dict[str, str]) -> str:
    if not files:
        return ""
    items = "".join(f"<li><code>{escape(f)}</code>: {escape(why)}</li>" for f, why in files.items())
    return f'<div class="skipped"><p>{escape(title)}</p><ul>{items}</ul></div>'


def overview_page(
    rows: Sequence[StepRow],
    watched: Sequence[tuple[str, int, int]],
    frequent: Sequence[tuple[str, int, int]],
    *,
    archive: str,
    total: int,
    skipped: dict[str, str] | None = None,
    left_out: dict[str, str] | None = None,
    page: int = 1,
    at: int | None = None,
) -> str:
    """The run's overview; its tables show `page` (1: the latest `PAGE_STEPS` steps of every
    split), or with `at` the page holding that step (the next one logged if it is not)."""
    numbers = sorted({r.step for r in rows})  # a step logged in several splits is one step
    last = max(1, -(-len(numbers) // PAGE_STEPS))
    if at is not None:
        page = (len(numbers) - 1 - min(bisect_left(numbers, at), len(numbers) - 1)) // PAGE_STEPS + 1
    if page > last:
        raise LookupError(f"no page {page}: the overview has {last} page{'s' if last > 1 else ''}")
    shown = set(numbers[max(0, len(numbers) - page * PAGE_STEPS) : len(numbers) - (page - 1) * PAGE_STEPS])
    pager = _pager(page, last, shown) if last > 1 else ""
    parts = [
        f'<p class="muted"><span data-k="records">{total:,}</span> records, '
        f'<span data-k="steps">{len(numbers):,}</span> steps. Click a step to open its groups.</p>',
        _left_out("Files left out:", skipped or {}),
        _left_out("Records left out:", left_out or {}),
        _prompt_list("Watched prompts", watched, "watched"),
    ]
    for split in split_order([r.split for r in rows]):
        mine = [r for r in rows if r.split == split]

        # Each step is linked from every chart and the table: its address is made once (at
        # 2,441 steps, making it each time was half of this page's time).
        addresses: dict[int, str] = {}

        def link(step: int, split: str = split, addresses: dict[int, str] = addresses) -> str:
            found = addresses.get(step)
            if found is None:
                found = addresses[step] = url("/step", split=split, step=step)
            return found

        zero = [(r.step, r.zero_signal / r.groups if r.groups else None) for r in mine]
        parts.append(f'<h2>split <code>{escape(split)}</code></h2><div class="charts">')
        charts: list[tuple[str, list[tuple[str, list[tuple[int, float | None]]]]]] = [
            (
                "reward",
                [
                    ("mean", [(r.step, r.reward_mean) for r in mine]),
                    ("std", [(r.step, r.reward_std) for r in mine]),
                ],
            ),
            (
                "share of zero-signal groups, of truncated completions",
                [("zero-signal groups", zero), ("truncated", [(r.step, r.truncated) for r in mine])],
            ),
            ("response length", [("mean", [(r.step, r.length_mean) for r in mine])]),
            ("policy-version lag", [("mean", [(r.step, r.lag_mean) for r in mine])]),
        ]
        parts += [line_chart(series, title=title, link=link) for title, series in charts]
        parts.append("</div>")
        parts.append(pager)
        parts.append(
            '<table class="steps"><thead><tr><th>step</th><th>samples</th><th>reward mean</th>'
            "<th>reward std</th><th>groups</th><th>zero-signal groups</th><th>mean group spread</th>"
            "<th>truncated</th><th>response length</th><th>lag mean</th><th>lag max</th></tr></thead><tbody>"
        )
        for r in mine:
            if r.step not in shown:
                continue
            parts.append(
                f'<tr data-split="{escape(r.split)}" data-step="{r.step}">'
                f'<td data-k="step"><a href="{escape(link(r.step))}">{r.step}</a></td>'
                + cell("samples", str(r.samples))
                + cell("reward_mean", num(r.reward_mean))
                + cell("reward_std", num(r.reward_std))
                + cell("groups", str(r.groups))
                + cell("zero_signal", str(r.zero_signal), "warn" if r.zero_signal else "")
                + cell("mean_spread", num(r.mean_spread))
                + cell("truncated", share(r.truncated))
                + cell("length_mean", num(r.length_mean, 1))
                + cell("lag_mean", num(r.lag_mean, 2))
                + cell("lag_max", "—" if r.lag_max is None else str(r.lag_max))
                + "</tr>"
            )
        parts.append("</tbody></table>")
    parts.append(_prompt_list("Prompts seen at the most steps", frequent, "frequent"))
    return layout("Run overview", "".join(parts), archive=archive)


def _pager(page: int, last: int, shown: set[int]) -> str:
    """Moves between the overview's pages (older steps on the left, as in the table) and a box
    that opens the page of any step."""
    moves = [
        (last, "first", "« first steps"),
        (page + 1, "older", "← older steps"),
        (page - 1, "newer", "newer steps →"),
        (1, "latest", "latest steps »"),
    ]
    links = " ".join(
        f'<a class="{cls}" href="{escape(url("/", page=n if n > 1 else None))}">{label}</a>'
        for n, cls, label in moves
        if 1 <= n <= last and n != page
    )
    return (
        f'<p class="moves pager">steps {min(shown)} to {max(shown)}, page '
        f'<span data-k="page">{page}</span> of <span data-k="pages">{last}</span>: {links}</p>'
        '<form class="jump" action="/" method="get"><input name="step" type="number" '
        'placeholder="step" aria-label="open the page of step"><button>go</button></form>'
    )


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


_UNFILTERED = StepFilter()
_ORDERS = (
    ("spread", "spread, highest first"),
    ("-spread", "spread, lowest first"),
    ("mean", "mean, highest first"),
    ("-mean", "mean, lowest first"),
)


def _filter_form(split: str, step: int, order: str, chosen: StepFilter) -> str:
    """The step's filters as a form that loads the same address with them (a GET: no script)."""

    def box(name: str, label: str, on: bool) -> str:
        checked = " checked" if on else ""
        return f'<label><input type="checkbox" name="{name}" value="1"{checked}> {label}</label>'

    signs = "".join(
        f'<option value="{v}"{" selected" if chosen.advantage == v else ""}>{label}</option>'
        for v, label in (("", "any"), ("pos", "above zero"), ("neg", "below zero"))
    )
    return (
        '<form class="filters" action="/step" method="get">'
        f'<input type="hidden" name="split" value="{escape(split)}">'
        f'<input type="hidden" name="step" value="{step}">'
        f'<input type="hidden" name="order" value="{escape(order)}">'
        + box("zero", "zero spread", chosen.zero)
        + box("truncated", "truncated", chosen.truncated)
        + box("tools", "tool calls", chosen.tools)
        + f'<label>mean advantage <select name="adv">{signs}</select></label><button>filter</button>'
        + (
            f' <a href="{escape(url("/step", split=split, step=step, order=order))}">clear</a>'
            if chosen
            else ""
        )
        + "</form>"
    )


def step_page(
    split: str,
    step: int,
    order: str,
    groups: Sequence[GroupRow],
    prompts: dict[str, str],
    *,
    archive: str,
    limit: int,
    chosen: StepFilter = _UNFILTERED,
    total: int | None = None,
    neighbours: tuple[int | None, int | None] = (None, None),
) -> str:
    """`groups` are those the filters `chosen` keep, of `total` at the step; `neighbours` are the
    split's steps before and after this one."""
    here = url("/step", split=split, step=step, **chosen.query())
    orders = " · ".join(
        f'<a href="{escape(url("/step", split=split, step=step, order=o, **chosen.query()))}"'
        f"{' class=on' if o == order else ''}>{label}</a>"
        for o, label in _ORDERS
    )
    before, after = neighbours
    moves = " ".join(
        f'<a class="{cls}" href="{escape(url("/step", split=split, step=n, order=order, **chosen.query()))}">'
        f"{label}</a>"
        for n, cls, label in ((before, "prev", f"← step {before}"), (after, "next", f"step {after} →"))
        if n is not None
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
                else cell("prompt_id", "—")
            )
            + cell("samples", str(g.samples))
            + cell("reward_mean", num(g.reward_mean))
            + cell("spread", num(g.spread))
            + cell("advantage_mean", num(g.advantage_mean))
            + cell("truncated", str(g.truncated))
            + f'<td data-k="signal">{"<span class=badge>zero spread</span>" if flat else ""}</td>'
            + cell("text", clip(prompts.get(g.first_id, "")), "text")
            + "</tr>"
        )
    every = url("/step", split=split, step=step, order=order, limit=len(groups), **chosen.query())
    more = (
        f'<p><a href="{escape(every)}">show all {len(groups)} groups</a></p>' if len(groups) > limit else ""
    )
    counted = f"{len(groups)} groups" if total is None or not chosen else f"{len(groups)} of {total} groups"
    body = (
        f'<p class="moves">{moves}</p>{_filter_form(split, step, order, chosen)}'
        f'<p class="muted"><span data-k="shown">{counted}</span>, {zero} with zero reward spread '
        "(no signal). "
        f"Rank by: {orders}</p>"
        '<table class="groups"><thead><tr><th>group</th><th>prompt id</th><th>samples</th>'
        "<th>reward mean</th><th>spread</th><th>advantage mean</th><th>truncated</th><th></th><th>prompt</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"
    )
    return layout(f"Step {step} ({split}): groups", body, archive=archive, crumbs=[(f"step {step}", here)])


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
    body = (
        f"<p>step {c.step} · split {escape(c.split)} · {' · '.join(links)}</p>"
        f"{completion_card(c, show_step=True, text=False)}"
        f'<h2>Prompt <span class="muted">{c.prompt_turns} messages</span></h2>'
        f'<section class="prompt">{turns_html(c.messages[: c.prompt_turns])}</section>'
        f'<h2>Completion <span class="muted">{len(c.messages) - c.prompt_turns} turns</span></h2>'
        f'<section class="completion-turns">{turns_html(c.messages, c.prompt_turns)}</section>'
        f'<h2>Metadata</h2><table class="meta">{meta}</table>'
    )
    return layout(
        f"Record {c.id}", body, archive=archive, crumbs=[(f"record {c.id}", url("/record", id=c.id))]
    )


def _search_form(query: dict[str, str], splits: Sequence[str]) -> str:
    options = "".join(
        f'<option value="{escape(s)}"{" selected" if query.get("split") == s else ""}>{escape(s)}</option>'
        for s in ["", *split_order(splits)]
    )
    return (
        '<form class="search" action="/find" method="get">'
        f'<label>id <input name="id" value="{escape(query.get("id", ""))}" '
        'placeholder="record, group or prompt"></label>'
        f'<label>text <input name="q" value="{escape(query.get("q", ""))}"></label>'
        f'<label>reward from <input name="low" size="6" value="{escape(query.get("low", ""))}"></label>'
        f'<label>to <input name="high" size="6" value="{escape(query.get("high", ""))}"></label>'
        f'<label>split <select name="split">{options}</select></label><button>find</button></form>'
    )


def names_page(
    name: str,
    prompts: Sequence[str],
    groups: Sequence[tuple[str, int]],
    *,
    archive: str,
    splits: Sequence[str],
) -> str:
    """What an id names when it is no record: the prompt's history in each split it occurs in,
    and each (split, step) where a group has that id."""
    items = [
        f'<li><a href="{escape(url("/prompt", id=name, split=s))}">prompt {escape(name)}</a> '
        f'<span class="muted">in split {escape(s)}</span></li>'
        for s in prompts
    ] + [
        f'<li><a href="{escape(url("/group", split=s, step=n, group=name))}">group {escape(name)}</a> '
        f'<span class="muted">at step {n} of split {escape(s)}</span></li>'
        for s, n in groups
    ]
    body = f'{_search_form({"id": name}, splits)}<ul class="names">{"".join(items)}</ul>'
    return layout(f"What {name} names", body, archive=archive)


def find_page(
    found: Sequence[Completion] | None,
    *,
    archive: str,
    query: dict[str, str],
    splits: Sequence[str],
    limit: int,
    text_index: tuple[int, int] = (0, 0),
) -> str:
    form = _search_form(query, splits)
    indexed, total = text_index
    if indexed < total:
        form += (
            f'<p class="muted" data-k="text-index">The text index is being built ({indexed} of {total} '
            "files so far): a search by text reads every message of the others, more slowly.</p>"
        )
    if found is None:
        return layout("Find", form, archive=archive)
    rows = "".join(
        f'<tr data-id="{escape(c.id)}">'
        f'<td><a href="{escape(url("/record", id=c.id))}">{escape(c.id)}</a></td>'
        f'<td data-k="step">{c.step}</td>'
        + cell("split", c.split)
        + cell("reward", num(c.reward))
        + (
            f'<td><a href="{escape(url("/group", split=c.split, step=c.step, group=c.group))}">'
            f"{escape(c.group)}</a></td>"
            if c.group is not None
            else "<td>—</td>"
        )
        + cell("text", clip(c.text), "text")
        + "</tr>"
        for c in found
    )
    note = f"{len(found)} records" + (f" (the first {limit})" if len(found) >= limit else "")
    body = (
        f'{form}<p class="muted">{note}</p><table class="found"><thead><tr><th>id</th><th>step</th>'
        f"<th>split</th><th>reward</th><th>group</th><th>completion</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    return layout("Find", body, archive=archive)
