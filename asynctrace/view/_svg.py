"""Charts drawn on the server as inline SVG: no script, no chart library, nothing fetched."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Member", "line_chart", "member_strip"]

_COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")

# A series with more points than the plot has pixels across is drawn through the lowest and the
# highest point of each 2-pixel column: the same line to the eye (spikes kept), and a page of a
# few hundred kB instead of megabytes at thousands of steps (each point is a linked mark).
_COLUMN_PX = 2


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    if high <= low:
        return [low]
    raw = _per(high, low, count)
    magnitude = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 0.0
    if not magnitude:  # two values a few subnormals apart
        return [low]
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    ticks = (first + i * step for i in range(int(_per(high, first, step) + 1e-9) + 1))
    return [tick for tick in ticks if math.isfinite(tick)]  # i * step may pass a float's range


def _per(high: float, low: float, divisor: float) -> float:
    """`(high - low) / divisor`, divided first where the difference is past a float's range
    (-1e308 to 1e308)."""
    difference = high - low
    return difference / divisor if math.isfinite(difference) else high / divisor - low / divisor


def _scale(low: float, high: float) -> Callable[[float], float]:
    """Where `value` lies from `high` (0) to `low` (1); halves, so that no difference of two
    finite values overflows, and the middle where the two are equal."""
    span = high / 2 - low / 2
    return lambda value: (high / 2 - value / 2) / span if span else 0.5


def _label(value: float) -> str:
    return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def line_chart(
    series: Sequence[tuple[str, Sequence[tuple[int, float | None]]]],
    *,
    title: str,
    link: Callable[[int], str] | None = None,
    width: int = 560,
    height: int = 180,
    dots: Sequence[tuple[int, float]] = (),
) -> str:
    """Lines of (x, y) points over integer x (steps); each point links to `link(x)` when given.

    `dots` are extra points drawn without a line (for example every sample's reward)."""
    points = [(x, y) for _, values in series for x, y in values if y is not None and math.isfinite(y)]
    points += [(x, y) for x, y in dots if math.isfinite(y)]
    left, right, top, bottom = 48, 12, 22, 24
    out = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>',
    ]
    if not points:
        out.append(f'<text x="{left}" y="{height // 2}" class="muted">no values</text></svg>')
        return "".join(out)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    down = _scale(y0, y1)

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * (width - left - right)

    def py(y: float) -> float:
        return top + down(y) * (height - top - bottom)

    for tick in _ticks(y0, y1):
        y = py(tick)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(
            f'<text x="{left - 4}" y="{y + 3:.1f}" class="axis" text-anchor="end">{_label(tick)}</text>'
        )
    for tick in _ticks(x0, x1, 6):
        if tick != int(tick):
            continue
        out.append(
            f'<text x="{px(tick):.1f}" y="{height - 8}" class="axis" text-anchor="middle">{int(tick)}</text>'
        )
    for x, y in dots:
        if math.isfinite(y):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2" class="dot"/>')
    for i, (name, values) in enumerate(series):
        color = _COLORS[i % len(_COLORS)]
        kept = _thin([(x, y) for x, y in values if y is not None and math.isfinite(y)], width - left - right)
        path = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(kept))
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for x, y in kept:
            mark = (
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}">'
                f"<title>{escape(name)} at step {x}: {y:.4g}</title></circle>"
            )
            out.append(f'<a href="{escape(link(x))}">{mark}</a>' if link else mark)
        out.append(
            f'<text x="{width - right - 4}" y="{14 + 12 * i}" text-anchor="end" fill="{color}" '
            f'class="legend">{escape(name)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _thin(points: list[tuple[int, float]], pixels: int) -> list[tuple[int, float]]:
    """`points` as drawn: all of them up to one a pixel across, else the lowest and
    highest of each column of `_COLUMN_PX` pixels and the two ends, in x order."""
    if len(points) <= pixels:
        return points
    points = sorted(points)
    x0, x1 = points[0][0], points[-1][0]
    columns = pixels // _COLUMN_PX
    span = (x1 - x0) or 1
    kept: list[tuple[int, float]] = []
    low = high = points[0]
    column = 0
    for point in points:
        here = min((point[0] - x0) * columns // span, columns - 1)
        if here != column:
            kept += [low, high]
            low = high = point
            column = here
        elif point[1] < low[1]:
            low = point
        elif point[1] > high[1]:
            high = point
    kept += [low, high]
    return sorted({*kept, points[0], points[-1]})  # the line spans the whole series


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a group as its strip draws it; `anchor` is its card's id on the page."""

    anchor: str
    label: str
    reward: float | None
    advantage: float | None
    length: int | None
    stop_reason: str | None
    truncated: bool


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def member_strip(members: Sequence[Member], *, width: int = 1100) -> str:
    """A group at a glance, one column per member linking to its card: a bar of its reward (from
    0; green where its advantage is positive, red where negative, grey at zero or none), a grey bar
    of its length below, and an amber frame and a mark when it was truncated. Hovering a column
    shows its numbers; every member fits in `width` pixels."""
    count = max(1, len(members))
    column = max(6, min(56, width // count))
    bars, lengths, label_height = 64, 14, 14
    height = bars + lengths + label_height + 10
    rewards = [r for m in members if (r := _finite(m.reward)) is not None]
    low, high = min([0.0, *rewards]), max([0.0, *rewards])
    if high == low:
        high = low + 1.0
    longest = max((m.length for m in members if m.length is not None and m.length > 0), default=1)

    down = _scale(low, high)

    def y(value: float) -> float:
        return 2 + down(value) * (bars - 4)

    out = [
        f'<svg class="members" viewBox="0 0 {column * count} {height}" width="{column * count}" '
        f'height="{height}" role="img" aria-label="reward, advantage, length, stop reason of each member">',
        f'<line x1="0" x2="{column * count}" y1="{y(0.0):.1f}" y2="{y(0.0):.1f}" class="grid"/>',
    ]
    for i, m in enumerate(members):
        x = i * column
        advantage = _finite(m.advantage)
        color = "#9ca3af" if not advantage else ("#16a34a" if advantage > 0 else "#dc2626")
        tip = (
            f"{m.label}: reward {_number(m.reward)}, advantage {_number(m.advantage)}, "
            f"length {'—' if m.length is None else m.length}, stop reason {m.stop_reason or '—'}"
        )
        parts = [f'<a href="#{escape(m.anchor)}" class="member"><title>{escape(tip)}</title>']
        parts.append(f'<rect x="{x}" y="0" width="{column}" height="{height}" class="hit"/>')
        reward = _finite(m.reward)
        if reward is not None:
            top, base = sorted((y(reward), y(0.0)))
            parts.append(
                f'<rect x="{x + 1}" y="{top:.1f}" width="{column - 2}" height="{max(1.0, base - top):.1f}" '
                f'fill="{color}"' + (' stroke="#d97706" stroke-width="2"' if m.truncated else "") + "/>"
            )
        else:
            parts.append(
                f'<text x="{x + column / 2:.1f}" y="{bars / 2}" class="axis" text-anchor="middle">?</text>'
            )
        if m.length is not None and m.length > 0:
            w = max(1.0, (column - 2) * m.length / longest)
            parts.append(
                f'<rect x="{x + 1}" y="{bars + 2}" width="{w:.1f}" height="{lengths - 4}" fill="#9ca3af"/>'
            )
        mark = "✂" if m.truncated else ""
        if column >= 28:
            mark = f"{_number(m.reward, 2)}{' ✂' if m.truncated else ''}"
        if mark:
            parts.append(
                f'<text x="{x + column / 2:.1f}" y="{bars + lengths + label_height}" class="axis'
                f'{" cut" if m.truncated else ""}" text-anchor="middle">{escape(mark)}</text>'
            )
        parts.append("</a>")
        out.append("".join(parts))
    out.append("</svg>")
    return "".join(out)


def _number(value: float | None, digits: int = 4) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"
