"""Latency histograms with label dimensions, as typed snapshots.

``Histograms.observe("rpc_seconds", 0.0004, method="Get", code="OK")`` files one duration under
fixed bucket bounds (seconds, from 50 us to 10 s: RPCs over a Unix socket take tens of
microseconds, an L2 batch tens of milliseconds). Readers get ``HistogramSample``s with
cumulative bucket counts, as Prometheus wants them; ``flat()`` writes them into the Stats RPC's
counter map (``rpc_seconds_bucket{code="OK",le="0.001",method="Get"}``, ``..._count``, and
``..._sum_us`` in whole microseconds, since that map holds integers), from which ``kvtier top``
derives quantiles over its refresh interval.

Thread-safety: none; owned by the event loop (RPC handlers and transfer completions run there).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.daemon.stats import Labels, flat_name

# Upper bounds in seconds; an implicit +Inf bucket follows.
BUCKETS_S: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSample:
    name: str
    labels: Labels
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # per bound, then +Inf (== count)
    sum_s: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Series:
    """One histogram series (a name and its labels): ``Histograms.series`` resolves it once
    for a caller on a hot path, which then files each duration with ``add``."""

    __slots__ = ("bounds", "counts", "sum_s")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum_s = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds


class Histograms:
    def __init__(self, bounds: tuple[float, ...] = BUCKETS_S) -> None:
        self.bounds = bounds
        self._series: dict[tuple[str, Labels], Series] = {}
        # Each series by (name, labels as passed): every RPC observes one, so the sorting and
        # string conversion of its labels happen once per distinct series (as in Counters).
        self._by_raw: dict[tuple[str, tuple[tuple[str, object], ...]], Series] = {}

    def observe(self, name: str, seconds: float, **labels: object) -> None:
        self.series(name, **labels).add(seconds)

    def series(self, name: str, **labels: object) -> Series:
        """The series ``name{labels}``, resolved once: a caller on a hot path keeps it and
        files durations with ``Series.add``, which then costs no label handling."""
        raw = (name, tuple(labels.items()))
        series = self._by_raw.get(raw)
        if series is None:
            key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = Series(self.bounds)
            self._by_raw[raw] = series
        return series

    def samples(self) -> Iterator[HistogramSample]:
        for (name, labels), series in sorted(self._series.items()):
            running = 0
            cumulative = []
            for c in series.counts:
                running += c
                cumulative.append(running)
            yield HistogramSample(name, labels, self.bounds, tuple(cumulative), series.sum_s)

    def flat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.samples():
            for bound, n in zip((*s.bounds, float("inf")), s.cumulative, strict=True):
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                out[flat_name(s.name + "_bucket", (*s.labels, ("le", le)))] = n
            out[flat_name(s.name + "_count", s.labels)] = s.count
            out[flat_name(s.name + "_sum_us", s.labels)] = round(s.sum_s * 1e6)
        return out


def quantile(bounds: tuple[float, ...], cumulative: list[int] | tuple[int, ...], q: float) -> float:
    """The ``q`` quantile of a histogram by linear interpolation inside its bucket (as
    Prometheus' ``histogram_quantile``); the last finite bound when it falls in +Inf; NaN for an
    empty histogram."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return float("nan")
    rank = q * total
    i = bisect.bisect_left(cumulative, rank)
    if i >= len(bounds):
        return bounds[-1]
    lo = bounds[i - 1] if i > 0 else 0.0
    below = cumulative[i - 1] if i > 0 else 0
    inside = cumulative[i] - below
    if inside <= 0:
        return bounds[i]
    return lo + (bounds[i] - lo) * (rank - below) / inside
