"""Counters with label dimensions, as typed snapshots.

A counter is a name plus labels (``tier="L1"``, ``direction="L1->L2"``, ``reason="checksum"``)
and only grows. Code counts with ``counters.inc("evictions", n, tier="L1")``; readers get
``Sample``s with the labels kept apart, so an exporter never parses names back. For the wire's
flat map (``StatsResponse.counters``) a sample is written ``name{key="value",...}``.

Thread-safety: none; owned by the event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]
CounterKey = tuple[str, Labels]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels
    value: int

    @property
    def key(self) -> str:
        return flat_name(self.name, self.labels)


def flat_name(name: str, labels: Labels) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


class Counters:
    def __init__(self) -> None:
        self._values: Counter[CounterKey] = Counter()
        # The canonical key of each (name, labels as passed): counting is on every request's
        # path, so the sorting and string conversion happen once per distinct counter.
        self._keys: dict[tuple[str, tuple[tuple[str, object], ...]], CounterKey] = {}

    def inc(self, name: str, n: int = 1, **labels: object) -> None:
        if n:
            self._values[self.key(name, **labels)] += n

    def key(self, name: str, **labels: object) -> CounterKey:
        """The counter ``name{labels}``, resolved once: a caller on a hot path keeps it and
        counts with ``add``, which then costs one dictionary update."""
        raw = (name, tuple(labels.items()))
        key = self._keys.get(raw)
        if key is None:
            key = self._keys[raw] = (
                name,
                tuple(sorted((k, str(v)) for k, v in labels.items())),
            )
        return key

    def add(self, key: CounterKey, n: int = 1) -> None:
        """``inc`` of a counter resolved with ``key``."""
        if n:
            self._values[key] += n

    def get(self, name: str, **labels: object) -> int:
        """One counter's value; with no labels given, the sum over all of its labels."""
        if labels:
            return self._values[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]
        return sum(v for (n, _), v in self._values.items() if n == name)

    def samples(self) -> Iterator[Sample]:
        for (name, labels), value in sorted(self._values.items()):
            yield Sample(name, labels, value)

    def flat(self) -> dict[str, int]:
        return {s.key: s.value for s in self.samples()}
