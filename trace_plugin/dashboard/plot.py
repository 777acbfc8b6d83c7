"""Line plots for an inline SVG, computed here so the page needs no script: success over
time per agent, and an expert's reward per training step.

The template draws what this returns; every label it carries is escaped there like any
other captured text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from trace_plugin.dashboard.queries import BUCKET_STEPS, Bucket, BucketStat, Marker

WIDTH, HEIGHT = 960, 320
CURVE_WIDTH, CURVE_HEIGHT = 560, 220  # one expert's training curves, several to a page
LEFT, RIGHT, TOP, BOTTOM = 56, 56, 16, 40  # room for centred time labels at both ends
MAX_X_TICKS = 8
# Colour-blind-safe palette (Okabe-Ito), cycled per series.
COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


@dataclass(frozen=True, slots=True)
class Point:
    x: float
    y: float
    title: str


@dataclass(slots=True)
class Series:
    name: str  # the agent, or the curve
    color: str
    points: list[Point] = field(default_factory=list)

    @property
    def polyline(self) -> str:
        return " ".join(f"{p.x:.1f},{p.y:.1f}" for p in self.points)


@dataclass(frozen=True, slots=True)
class Tick:
    pos: float
    label: str


@dataclass(frozen=True, slots=True)
class PlacedMarker:
    x: float
    label: str
    title: str


@dataclass(frozen=True, slots=True)
class Plot:
    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    series: list[Series]
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    markers: list[PlacedMarker]


def build_plot(stats: Sequence[BucketStat], bucket: Bucket, markers: Sequence[Marker] = ()) -> Plot | None:
    """Lines of success rate per agent over time, with the markers inside the time range;
    None when no episode has an outcome to plot."""
    if not stats:
        return None
    step = BUCKET_STEPS[bucket]
    first = min(s.start for s in stats)
    last = max(s.start for s in stats) + step  # a bucket spans [start, start + step)
    span = (last - first).total_seconds()
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x_of(at: datetime) -> float:
        return LEFT + inner_w * (at - first).total_seconds() / span

    def y_of(rate: float) -> float:
        return TOP + inner_h * (1 - rate)

    fmt = {"minute": "%Y-%m-%d %H:%M", "hour": "%Y-%m-%d %H:00", "day": "%Y-%m-%d"}[bucket]
    series: dict[str, Series] = {}
    for s in stats:
        line = series.setdefault(s.agent, Series(s.agent, COLORS[len(series) % len(COLORS)]))
        title = f"{s.agent} · {s.start.strftime(fmt)} UTC · {s.successes}/{s.with_outcome} = {s.rate:.0%}"
        line.points.append(Point(x_of(s.start + step / 2), y_of(s.rate), title))

    buckets = round((last - first) / step)
    every = -(-buckets // MAX_X_TICKS)  # ticks on bucket boundaries, at most MAX_X_TICKS + 1
    x_ticks = [
        Tick(x_of(first + step * i), (first + step * i).strftime(fmt)) for i in range(0, buckets + 1, every)
    ]
    y_ticks = [Tick(y_of(r / 4), f"{r * 25}%") for r in range(5)]
    placed = [
        PlacedMarker(x_of(m.at), m.label, f"{m.label} · {m.at.strftime('%Y-%m-%d %H:%M')} UTC")
        for m in markers
        if first <= m.at <= last
    ]
    return Plot(WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM, list(series.values()), x_ticks, y_ticks, placed)


def build_curve_plot(curves: Mapping[str, Sequence[float | None]]) -> Plot | None:
    """One line per curve of a value per training step (step 1 first); a step a curve has
    no value for (None) is left out of that line. The y axis spans 0 to 1, wider only where
    a value falls outside. None when no curve has a value."""
    values = [v for curve in curves.values() for v in curve if v is not None]
    if not values:
        return None
    steps = max(len(curve) for curve in curves.values())
    low, high = min(0.0, *values), max(1.0, *values)
    inner_w, inner_h = CURVE_WIDTH - LEFT - RIGHT, CURVE_HEIGHT - TOP - BOTTOM

    def x_of(step: int) -> float:
        return LEFT + inner_w * ((step - 1) / (steps - 1) if steps > 1 else 0.5)

    def y_of(value: float) -> float:
        return TOP + inner_h * (high - value) / (high - low)

    series = []
    for i, (name, curve) in enumerate(curves.items()):
        line = Series(name, COLORS[i % len(COLORS)])
        for step, value in enumerate(curve, 1):
            if value is not None:
                line.points.append(Point(x_of(step), y_of(value), f"{name} · step {step} · {value:.3f}"))
        series.append(line)
    every = -(-steps // MAX_X_TICKS)
    x_ticks = [Tick(x_of(step), str(step)) for step in range(1, steps + 1, every)]
    y_ticks = [Tick(y_of(low + (high - low) * r / 4), f"{low + (high - low) * r / 4:.2f}") for r in range(5)]
    return Plot(CURVE_WIDTH, CURVE_HEIGHT, LEFT, RIGHT, TOP, BOTTOM, series, x_ticks, y_ticks, [])
