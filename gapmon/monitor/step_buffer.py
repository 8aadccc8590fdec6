"""What end_step moves: named float64 segments of one flat tensor (reduced over ranks in one collective,
or copied to the host in one transfer), and the cached pickers that turn the host copy into metrics
without a Python loop over thousands of metric names."""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch

from .metric_names import metric_name


class StepBuffer:
    """Named float64 segments of one flat device tensor, without offset arithmetic at the call sites."""

    def __init__(self, device: torch.device):
        self.device = device
        self._parts: list[torch.Tensor] = []
        self.spans: dict[str, tuple[int, int]] = {}
        self._size = 0

    def add(self, name: str, values: torch.Tensor) -> None:
        flat = values.reshape(-1).to(self.device, torch.float64)
        self.spans[name] = (self._size, self._size + flat.numel())
        self._size += flat.numel()
        self._parts.append(flat)

    def cat(self) -> torch.Tensor:
        return torch.cat(self._parts) if self._parts else torch.empty(0, dtype=torch.float64, device=self.device)

    def of(self, flat: Any, name: str) -> Any:
        """Segment `name` of `flat` (the tensor cat() made, or the host list of its values)."""
        start, end = self.spans[name]
        return flat[start:end]

    def start(self, name: str) -> int:
        return self.spans[name][0]


def picker(indices: list[int]) -> Callable[[Any], tuple]:
    """A function that returns [values[i] for i in indices] as a tuple, in C."""
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        return lambda values: (values[indices[0]],)
    return operator.itemgetter(*indices)


class MetricPickers:
    """Metric names of (kind, name, field) and pickers of their values in the host copy, built once per
    set of rows: end_step runs every monitored step and reports thousands of metrics."""

    def __init__(self, fields: tuple[str, ...]):
        self.fields = fields
        self._keys: dict[tuple[str, str], tuple[str, ...]] = {}
        self._pickers: dict[str, tuple] = {}

    def keys(self, kind: str, name: str) -> tuple[str, ...]:
        """The metric names of (kind, name), one per field."""
        keys = self._keys.get((kind, name))
        if keys is None:
            keys = self._keys[(kind, name)] = tuple(metric_name(kind, name, field) for field in self.fields)
        return keys

    def picked(self, slot: str, rows: tuple[tuple[str, str, int], ...], columns: Iterable[int]) -> tuple[list[str], Any]:
        """Metric names of `rows` ((kind, name, offset of its values in the host list) each) and a function
        picking the values at offset + `columns` out of that list. `slot` names the cache."""
        cached = self._pickers.get(slot)
        if cached is None or cached[0] != rows:
            columns = list(columns)
            keys = [key for kind, name, _ in rows for key in self.keys(kind, name)]
            cached = self._pickers[slot] = (rows, keys, picker([at + col for *_, at in rows for col in columns]))
        return cached[1], cached[2]

    def cached(self, slot: str, key: Any, build: Callable[[], Any]) -> Any:
        """build()'s result, kept until `key` changes."""
        cached = self._pickers.get(slot)
        if cached is None or cached[0] != key:
            cached = self._pickers[slot] = (key, build())
        return cached[1]
