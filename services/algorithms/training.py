"""The training recipe of a job: `[optimizer]`, `[schedule]` and `[loss]` (docs/training.md).

Each is a torch class or function by name, its keyword arguments the table's other keys; the
`server` subtable gives the worker's side its own. These models check only the shape of the
tables, without torch (`splitmq check` loads the config); `services.algorithms.recipe` checks
the names and arguments against torch, which the job's validation calls when a recipe is set.
The same models parse the recipe a client receives in its config map (`as_config`).
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A keyword argument's value as TOML gives it (a list of them becomes a tuple: betas).
Scalar = str | int | float | bool

CROSS_ENTROPY = "cross_entropy"
# The keys of a client's config map that carry the recipe, each a table as JSON (`as_config`).
OPTIMIZER_KEY, SCHEDULE_KEY, LOSS_KEY = "optimizer", "schedule", "loss"
# What an optimizer class or function name may look like: a name, or "package.module:name".
_NAME = r"^([A-Za-z_][A-Za-z0-9_]*)?$"
_CALLABLE = r"^([A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*)$"


class _Table(BaseModel):
    """Like every settings section: unknown keys are errors, values frozen. (Its own base:
    the algorithms layer sits below `services.config`, which builds on these tables.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TorchChoice(_Table):
    """A class or function by `name`, called with the table's other keys as keyword arguments."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(default="", pattern=_NAME)

    @model_validator(mode="before")
    @classmethod
    def _plain_arguments(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, value in data.items():
            if key in cls.model_fields:
                continue
            if isinstance(value, list):
                value = tuple(value)
            items = value if isinstance(value, tuple) else (value,)
            if not all(isinstance(v, Scalar) for v in items):
                raise ValueError(
                    f"{key}: a keyword argument must be a number, a string, a boolean or a "
                    f"list of them, got {value!r}"
                )
            out[key] = value
        return out

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments (every key but the fields)."""
        return dict(self.model_extra or {})

    def as_config(self) -> str:
        """The table as one JSON string: how it travels in a client's config map."""
        return self.model_dump_json()


class ScheduleChoice(TorchChoice):
    # "round": stepped once per round, round r (from 0) trains with the lr after r steps;
    # "step": stepped after every optimizer step, counted across rounds.
    every: Literal["round", "step"] = "round"


class OptimizerSection(TorchChoice):
    """`[optimizer]`: the client's optimizer, and the server's unless `[optimizer.server]`;
    no name: SGD from `algorithm.lr`, `momentum` and `server_lr`."""

    server: TorchChoice | None = None

    @model_validator(mode="after")
    def _named(self) -> Self:
        if not self.name and self.model_extra:
            raise ValueError(
                f"optimizer: arguments {sorted(self.model_extra)} but no name; say which "
                'optimizer (name = "adamw", "sgd", "adam", ...)'
            )
        if self.server is not None and not self.server.name:
            raise ValueError(
                'optimizer.server: no name; say which optimizer the server uses (name = "sgd")'
            )
        return self

    @property
    def server_side(self) -> TorchChoice | None:
        """The server's optimizer: its own, else the client's; None: SGD from [algorithm]."""
        return self.server or (self if self.name else None)

    @property
    def client_side(self) -> TorchChoice | None:
        return self if self.name else None


class ScheduleSection(ScheduleChoice):
    """`[schedule]`: the client's lr schedule, and the server's unless `[schedule.server]`
    (whose empty name means none); no name: a constant lr."""

    server: ScheduleChoice | None = None

    @model_validator(mode="after")
    def _named(self) -> Self:
        if not self.name and self.model_extra:
            raise ValueError(
                f"schedule: arguments {sorted(self.model_extra)} but no name; say which "
                'torch.optim.lr_scheduler class (name = "cosineannealinglr", "steplr", ...)'
            )
        return self

    @property
    def client_side(self) -> ScheduleChoice | None:
        return self if self.name else None

    @property
    def server_side(self) -> ScheduleChoice | None:
        chosen = self.server if self.server is not None else self
        return chosen if chosen.name else None


class LossSection(TorchChoice):
    """`[loss]`: cross-entropy with its keyword arguments, or a user's `module:function`
    called as `fn(logits, labels, **arguments)`."""

    name: str = Field(default=CROSS_ENTROPY, pattern=_CALLABLE)

    @property
    def is_default(self) -> bool:
        return self.name == CROSS_ENTROPY and not self.model_extra
