"""Algorithm name → its `AlgorithmSpec` (services.algorithms.base), built-in or a plugin's.

A module defines its algorithms with the `algorithm` decorator, which only records the spec on
the class; a `Registry` imports modules when a name is first asked for and reads the specs of
the classes defined there. Built-ins are found through `BUILTINS`, an index of our own like an
entry-point table, so that the config checks a name without importing torch (`splitmq check`
runs every few seconds as a healthcheck); the index must name what the module registers, or
the registry refuses it. Other packages add algorithms through the entry-point group
`splitmq.algorithms` (`name = "package.module"`), imported only when a name is not a
built-in's: `docs/algorithms.md` "Write your own algorithm".
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from functools import partial
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # base imports torch, which the config must not (module docstring)
    from services.algorithms.base import AlgorithmSpec, Params, StrategyBase

GROUP = "splitmq.algorithms"
BUILTINS: Mapping[str, str] = {
    "fedavg": "fedavg",
    "sfl_v1": "sfl",
    "sfl_v2": "sfl",
    "sfl": "sfl",
    "minibatch_sfl": "minibatch_sfl",
    "splitgp": "splitgp",
    "fedsplitx": "fedsplitx",
    "local_loss_sfl": "fedsplitx",
    "feddeper": "feddeper",
    "subfedavg": "subfedavg",
    "standalone": "standalone",
}


class AlgorithmPluginError(ValueError):
    """A plugin of the `splitmq.algorithms` group could not be loaded."""


def specs_in(source: object) -> list[AlgorithmSpec]:
    """The specs of a class, or of the classes a module defines itself (not those it imports)."""
    from services.algorithms.base import StrategyBase

    if isinstance(source, ModuleType):
        classes = [
            c
            for c in vars(source).values()
            if inspect.isclass(c) and c.__module__ == source.__name__
        ]
    elif inspect.isclass(source):
        classes = [source]
    else:
        raise TypeError(f"expected a module or a strategy class, got {source!r}")
    return [
        s for c in classes if issubclass(c, StrategyBase) for s in vars(c).get("_registrations", ())
    ]


class Registry:
    """The algorithms of one process (tests build their own, with other modules or group)."""

    def __init__(self, builtins: Mapping[str, str] = BUILTINS, group: str = GROUP) -> None:
        self._builtins = {name: f"services.algorithms.{m}" for name, m in builtins.items()}
        self._group = group
        self._specs: dict[str, AlgorithmSpec] = {}
        self._plugins: dict[str, EntryPoint] | None = None

    def add(self, source: object) -> list[AlgorithmSpec]:
        """Register what a module or class declares; `ValueError` when a name is taken."""
        found = specs_in(source)
        for spec in found:
            known = self._specs.get(spec.name)
            if known is not None and known.strategy is not spec.strategy:
                raise ValueError(
                    f"algorithm {spec.name!r} registered twice: by "
                    f"{known.strategy.__qualname__} and {spec.strategy.__qualname__}"
                )
            self._specs[spec.name] = spec
        return found

    def names(self) -> list[str]:
        """Every known name, built-in or a plugin's (the plugins' without importing them)."""
        return sorted({*self._builtins, *self._entry_points(), *self._specs})

    def known(self, name: str) -> bool:
        """Whether `name` is an algorithm, without importing it (nor torch)."""
        return name in self._builtins or name in self._specs or name in self._entry_points()

    def check(self, name: str) -> None:
        """`ValueError` unless `name` is an algorithm: a built-in's name (nothing imported) or
        a plugin that imports and registers it (its failure is told here, at load time)."""
        if name not in self._builtins:
            self.get(name)

    def get(self, name: str) -> AlgorithmSpec:
        """The spec of `name`, its module imported if need be; `ValueError` if unknown."""
        spec = self._specs.get(name)
        if spec is None:
            self._import(name)
            spec = self._specs.get(name)
        if spec is None:
            raise ValueError(f"unknown algorithm {name!r}; known: {self.names()}")
        return spec

    def section(self, key: str) -> type[Params] | None:
        """The parameter section `[algorithm.<key>]`: that of the algorithm named `key`."""
        if not self.known(key):
            return None
        spec = self.get(key)
        return spec.params if spec.section == key else None

    def build(self, name: str, params: Mapping[str, object] | None = None) -> StrategyBase:
        """The strategy `name` with `params`; `ValueError` for an unknown name or bad params."""
        return self.get(name).build(params)

    # --- loading ----------------------------------------------------------------------------
    def _import(self, name: str) -> None:
        module = self._builtins.get(name)
        load: Callable[[], object]
        if module is not None:
            label, load = module, partial(importlib.import_module, module)
        else:
            entry = self._entry_points().get(name)
            if entry is None:
                return
            label, load = f"plugin {entry.name!r} ({entry.value})", entry.load
        try:
            source = load()
        except Exception as exc:  # every ask says why, not only the first
            raise AlgorithmPluginError(f"algorithm {label} failed to import: {exc!r}") from exc
        if name not in {spec.name for spec in self.add(source)}:
            raise AlgorithmPluginError(f"algorithm {label} registers no algorithm {[name]}")

    def _entry_points(self) -> dict[str, EntryPoint]:
        if self._plugins is None:
            self._plugins = {ep.name: ep for ep in entry_points(group=self._group)}
        return self._plugins


# The process's registry: roles and the config look algorithms up here.
REGISTRY = Registry()


def build_strategy(name: str, params: Mapping[str, object] | None = None) -> StrategyBase:
    """`REGISTRY.build`: the strategy `name` with `params` (`ValueError` when bad)."""
    return REGISTRY.build(name, params)
