"""Charts drawn on the server as inline SVG: no script, no chart library, nothing fetched."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

__all__ = ["line_chart"]

_COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


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

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * (width - left - right)

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * (height - top - bottom)

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
        kept = [(x, y) for x, y in values if y is not None and math.isfinite(y)]
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
