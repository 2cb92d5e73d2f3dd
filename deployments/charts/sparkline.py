"""A small line chart of a deployment's decode speed, drawn on the server as an SVG path.

`sparkline(samples, now)` turns (time, tokens/s or None) pairs into the `d` of an SVG path in a fixed
viewBox: time runs left to right over the window (the last hour), speed bottom to top from 0 to the highest
value in the window. A sample without a speed (no generation in that interval) breaks the line; a lone
sample between two gaps is a dot. No JavaScript, no inline style: the template draws one <path>.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

WINDOW = timedelta(hours=1)
WIDTH, HEIGHT, PAD = 160, 32, 2


@dataclass
class Sparkline:
    path: str = ""  # the SVG path's `d`; "" when there is nothing to draw
    dots: list[tuple[float, float]] = field(default_factory=list)  # lone samples
    count: int = 0  # samples with a speed in the window
    last: float | None = None  # the latest speed in the window
    peak: float | None = None  # the highest
    low: float | None = None  # the lowest
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def empty(self) -> bool:
        return self.count == 0


def _fmt(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def sparkline(
    samples: Iterable[tuple[datetime, float | None]],
    now: datetime,
    *,
    window: timedelta = WINDOW,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> Sparkline:
    start = now - window
    points = sorted((at, value) for at, value in samples if start <= at <= now)
    values = [v for _, v in points if v is not None]
    if not values:
        return Sparkline(width=width, height=height)
    peak = max(values)
    span = window.total_seconds()

    def xy(at: datetime, value: float) -> tuple[float, float]:
        x = PAD + (width - 2 * PAD) * (at - start).total_seconds() / span
        y = height - PAD - (height - 2 * PAD) * (value / peak if peak > 0 else 0.0)
        return round(x, 1), round(y, 1)

    runs: list[list[tuple[float, float]]] = [[]]
    for at, value in points:
        if value is None:
            if runs[-1]:
                runs.append([])
            continue
        runs[-1].append(xy(at, value))
    parts, dots = [], []
    for run in runs:
        if len(run) == 1:
            dots.append(run[0])
        elif run:
            head, *rest = run
            parts.append(
                f"M{_fmt(head[0])} {_fmt(head[1])}" + "".join(f"L{_fmt(x)} {_fmt(y)}" for x, y in rest)
            )
    return Sparkline(
        path="".join(parts),
        dots=dots,
        count=len(values),
        last=values[-1],
        peak=peak,
        low=min(values),
        width=width,
        height=height,
    )
