"""TOML file + environment → `Settings`.

Precedence: environment over file over defaults. Environment names are ``SPLITMQ_`` followed by
the dotted path with ``__`` between levels (``SPLITMQ_BROKER__KIND=rabbitmq``), plus short
aliases for the settings people change most (``SPLITMQ_AMQP_URL``, ``SPLITMQ_REDIS_URL``...).
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from services.algorithms.hints import did_you_mean
from services.algorithms.registry import REGISTRY
from services.config.job import AlgorithmSection
from services.config.root import Settings

_log = logging.getLogger("splitmq.config")

ENV_PREFIX = "SPLITMQ_"
ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "SPLITMQ_AMQP_URL": ("broker", "amqp_url"),
    "SPLITMQ_AMQP_URLS": ("broker", "amqp_urls"),
    "SPLITMQ_REDIS_URL": ("store", "redis_url"),
    "SPLITMQ_REDIS_SENTINELS": ("store", "sentinels"),
    "SPLITMQ_BROKER": ("broker", "kind"),
    "SPLITMQ_STORE": ("store", "kind"),
    "SPLITMQ_LOG_LEVEL": ("log_level",),
    "SPLITMQ_LOG_FORMAT": ("log_format",),
}


class ConfigError(ValueError):
    """A configuration file or variable is unreadable or invalid; the message says where."""


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_bytes().decode())  # what tomllib.load does
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def _section(model: type[BaseModel], path: Sequence[object]) -> type[BaseModel] | None:
    """The section (model) that `path` names inside `model`, None if it names none."""
    for part in path:
        field = model.model_fields.get(str(part))
        section = field.annotation if field is not None else None
        if field is None and model is AlgorithmSection:
            # An algorithm's parameter table (SPLITMQ_ALGORITHM__SPLITGP__GAMMA): the sections
            # come from the algorithms' registrations, not from fields.
            section = REGISTRY.section(str(part))
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return None
        model = section
    return model


def _toml_value(value: str) -> Any:
    """A free-form key's value read as TOML (`0.5`, `true`, `[0.9, 0.999]`), as the file would
    give it, else kept as the string."""
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _unknown_key_warning(model: type[BaseModel], key: str, path: tuple[str, ...]) -> None:
    """A variable under a known section that names none of its settings is ignored (it may be
    another program's), but a typo must not pass unseen: say so, with the nearest setting."""
    if len(path) < 2 or _section(model, path[:1]) is None:
        return
    section = _section(model, path[:-1])
    hint = did_you_mean(path[-1], section.model_fields) if section is not None else ""
    _log.warning("%s is ignored: %s is no setting%s", key, ".".join(path), hint)


def _error_line(error: ErrorDetails) -> str:
    """`section.key: what is wrong`; an unknown key gets the nearest valid one of its section."""
    loc, where = error["loc"], ".".join(map(str, error["loc"]))
    message = error["msg"].removeprefix("Value error, ")
    # A section's own check names the keys inside it (algorithm.batch_szie: ...).
    # A whole-file check (loc ()) names its keys itself.
    named = not where or message.startswith(f"{where}.")
    line = f"  {message}" if named else f"  {where}: {message}"
    section = _section(Settings, loc[:-1]) if error["type"] == "extra_forbidden" else None
    if section is None:
        return line
    key = str(loc[-1])
    return line + (_home_section(key) or did_you_mean(key, section.model_fields))


def _home_section(key: str) -> str:
    """': KEY belongs in [SECTION]' when another top-level section has that very setting (a
    key put under the wrong table), '' when none has."""
    for name, field in Settings.model_fields.items():
        home = field.annotation
        if isinstance(home, type) and issubclass(home, BaseModel) and key in home.model_fields:
            return f": {key} belongs in [{name}]"
    return ""


def env_overrides(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict of the overrides that `env` holds for `model`."""
    out: dict[str, Any] = {}
    for key, value in sorted(env.items()):
        if not key.startswith(ENV_PREFIX):  # the aliases too
            continue
        path = ENV_ALIASES.get(key) or tuple(key.removeprefix(ENV_PREFIX).lower().split("__"))
        # `path` must name a field (unrelated SPLITMQ_* variables are ignored), or a key of a
        # free-form table (the recipe's `[optimizer]`: any keyword argument).
        section = _section(model, path[:-1])
        declared = section is not None and path[-1] in section.model_fields
        if not declared and (section is None or section.model_config.get("extra") != "allow"):
            _unknown_key_warning(model, key, path)
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # A declared field's value stays a string: pydantic converts it.
        node[path[-1]] = value if declared else _toml_value(value)
    return out


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_settings(path: Path | str | None, env: Mapping[str, str] | None = None) -> Settings:
    """`Settings` from an optional TOML file (a path or its name) and the environment
    (`env`; none when omitted: a notebook or a script gets exactly the file's settings)."""
    path = Path(path) if isinstance(path, str) else path
    overrides = env_overrides(Settings, env or {})
    data = deep_merge(read_toml(path) if path is not None else {}, overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        lines = [f"invalid configuration ({path or 'environment'}):"]
        lines += map(_error_line, exc.errors())
        raise ConfigError("\n".join(lines)) from None
