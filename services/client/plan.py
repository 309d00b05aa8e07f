"""The training parameters a client uses: its settings, overridden by what the service sends.

Welcome and WeightsAssignment carry a `config` map (architecture step 2): an edge client's own
file may be stale or partial, the service's word is the one every participant shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from pydantic import ValidationError

from broker.messages import ConfigValue
from services.algorithms.base import Hyper
from services.algorithms.recipe import check_recipe
from services.algorithms.registry import REGISTRY
from services.algorithms.training import (
    LOSS_KEY,
    OPTIMIZER_KEY,
    SCHEDULE_KEY,
    LossSection,
    OptimizerSection,
    ScheduleSection,
    TorchChoice,
)
from services.common.jobmodel import job_hyper
from services.config.root import Settings

# Config keys that carry the algorithm's own parameters.
PARAMS_PREFIX = "params."

WIRE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)


@dataclass(frozen=True)
class RoundPlan:
    algorithm: str
    batch_size: int
    hyper: Hyper
    smashed_dtype: str
    # The algorithm's own parameters ([algorithm.<name>]); the service sends them as
    # `params.<key>` config entries.
    params: Mapping[str, ConfigValue] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_settings(cls, settings: Settings) -> RoundPlan:
        a = settings.algorithm
        return cls(
            a.name, a.batch_size, job_hyper(settings), a.smashed_dtype, MappingProxyType(a.params())
        )

    def updated(self, config: Mapping[str, ConfigValue]) -> RoundPlan:
        """This plan with the known keys of `config` applied (`ValueError` on a bad one);
        unknown keys (partition, finished, ...) are other parts' business."""
        changes: dict[str, Any] = {}
        hyper: dict[str, Any] = {}
        if "algorithm" in config:
            name = config["algorithm"]
            if not isinstance(name, str) or not REGISTRY.known(name):
                raise ValueError(f"config.algorithm: unknown algorithm {name!r}")
            changes["algorithm"] = name
        if "batch_size" in config:
            changes["batch_size"] = _int(config, "batch_size", 1)
        for key, field_name, minimum in (
            ("local_epochs", "local_epochs", 1),
            ("max_steps_per_round", "max_steps", 0),
        ):
            if key in config:
                hyper[field_name] = _int(config, key, minimum)
        for key in ("lr", "momentum", "server_lr"):
            if key in config:
                hyper[key] = _float(config, key)
        if "smashed_dtype" in config:
            dtype = config["smashed_dtype"]
            if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
                raise ValueError(
                    f"config.smashed_dtype: {dtype!r} is not one of {list(WIRE_DTYPES)}"
                )
            changes["smashed_dtype"] = dtype
        sent = {
            k[len(PARAMS_PREFIX) :]: v for k, v in config.items() if k.startswith(PARAMS_PREFIX)
        }
        if sent or "algorithm" in changes:
            # The service's parameters replace ours whole: ours may belong to another algorithm.
            changes["params"] = MappingProxyType(sent)
        hyper.update(_recipe(config, self.hyper))
        h = replace(self.hyper, **hyper)
        if h.lr <= 0 or not 0 <= h.momentum < 1 or h.server_lr < 0:
            raise ValueError(
                f"config: need lr > 0, 0 <= momentum < 1, server_lr >= 0; got lr={h.lr}, "
                f"momentum={h.momentum}, server_lr={h.server_lr}"
            )
        return replace(self, hyper=h, **changes)

    @property
    def wire_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.smashed_dtype]


# Config key -> (the Hyper field it sets, its table's model).
_RECIPE: Mapping[str, tuple[str, type[TorchChoice]]] = MappingProxyType(
    {
        OPTIMIZER_KEY: ("optimizers", OptimizerSection),
        SCHEDULE_KEY: ("schedules", ScheduleSection),
        LOSS_KEY: ("losses", LossSection),
    }
)


def _recipe(config: Mapping[str, ConfigValue], current: Hyper) -> dict[str, Any]:
    """The recipe's tables the service sent (JSON strings), validated as the job file's are
    (against torch when they change `current`'s)."""
    out: dict[str, Any] = {}
    for key, (field_name, model) in _RECIPE.items():
        if key not in config:
            continue
        raw = config[key]
        if not isinstance(raw, str):
            raise ValueError(f"config.{key}: expected the table as a JSON string, got {raw!r}")
        try:
            out[field_name] = model.model_validate_json(raw)
        except ValidationError as exc:
            problems = "; ".join(f"{e['loc']}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"config.{key}: {problems}") from None
    changed = replace(current, **out)
    if (changed.optimizers, changed.schedules, changed.losses) != (
        current.optimizers,
        current.schedules,
        current.losses,
    ):
        try:
            check_recipe(changed.optimizers, changed.schedules, changed.losses)
        except ValueError as exc:
            raise ValueError(f"config: the service's recipe is unusable here: {exc}") from None
    return out


def config_int(config: Mapping[str, ConfigValue], key: str) -> int | None:
    """An optional non-negative integer entry (partition, shard); `ValueError` if malformed."""
    return _int(config, key, 0) if key in config else None


def _int(config: Mapping[str, ConfigValue], key: str, minimum: int) -> int:
    value = config[key]
    # bool is an int subclass; True is not a batch size.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config.{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _float(config: Mapping[str, ConfigValue], key: str) -> float:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config.{key}: expected a number, got {value!r}")
    return float(value)
