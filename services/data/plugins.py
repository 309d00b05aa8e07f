"""Datasets of other packages, through the entry-point group `splitmq.datasets`.

An entry point ``name = "package.module:attribute"`` makes `[data] dataset = "name"` load
what the attribute is (docs/data.md, "Your own dataset"):

- a `DatasetSpec`: files in the data directory, found and read like the built-ins';
- a callable taking the job's `DataRequest` and returning `LabelledArrays`: data made by code
  (a download cache, a database, synthetic data). Every process that builds the model calls
  it to learn the input shape unless `[data] input_shape` is set, so it should be cheap or
  cached by the plugin on disk.

Entry points are read when a name is neither a built-in nor a generic kind, and a plugin is
imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Protocol

from services.data.arrays import LabelledArrays
from services.data.errors import DataError
from services.data.registry import DatasetSpec
from services.data.request import DataRequest

GROUP = "splitmq.datasets"

Loader = Callable[[DataRequest], LabelledArrays]


class DatasetPluginError(DataError, ValueError):
    """A plugin of the `splitmq.datasets` group could not be loaded, or is not a dataset."""


class PluginLookup(Protocol):
    """Where the loaders look a plugin's name up (`Plugins`, or a test's own)."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> DatasetSpec | Loader | None: ...


class Plugins:
    """The dataset plugins installed for one process (tests pass their own group)."""

    def __init__(self, group: str = GROUP) -> None:
        self._group = group
        self._entries: Mapping[str, EntryPoint] | None = None

    def names(self) -> list[str]:
        return sorted(self._entry_points())

    def get(self, name: str) -> DatasetSpec | Loader | None:
        """What plugin `name` provides; None when no plugin has that name."""
        entry = self._entry_points().get(name)
        if entry is None:
            return None
        label = f"dataset plugin {entry.name!r} ({entry.value})"
        try:
            source = entry.load()
        except Exception as exc:  # the user's import fails in arbitrary ways: say whose it is
            raise DatasetPluginError(f"{label} failed to import: {exc!r}") from exc
        if isinstance(source, DatasetSpec):
            return source
        if callable(source):
            loader: Loader = source
            return loader
        raise DatasetPluginError(
            f"{label} is a {type(source).__name__}: expected a DatasetSpec or a function "
            "taking a DataRequest and returning LabelledArrays"
        )

    def _entry_points(self) -> Mapping[str, EntryPoint]:
        if self._entries is None:
            self._entries = {ep.name: ep for ep in entry_points(group=self._group)}
        return self._entries
