"""Write the effective settings back as TOML, with secrets redacted.

tomllib only reads; the small writer below covers what `Settings.model_dump()` produces
(nested tables of strings, numbers, booleans, lists).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse, urlunparse

SECRET_KEYS = frozenset({"password", "secret", "token", "api_key"})
REDACTED = "***"


def redact_url(url: str) -> str:
    """`url` without its password (``amqp://user:***@host``); other strings unchanged."""
    try:
        parts = urlparse(url)
        password = parts.password
    except ValueError:
        return url
    if not parts.scheme or password is None:
        return url
    netloc = parts.netloc.replace(f":{password}@", f":{REDACTED}@", 1)
    return urlunparse(parts._replace(netloc=netloc))


def redact(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `data` with URL passwords and secret-named keys masked, at any depth."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out[key] = redact(value)
        elif key.lower() in SECRET_KEYS and value:
            out[key] = REDACTED
        elif isinstance(value, str):
            out[key] = redact_url(value)
        else:
            out[key] = value
    return out


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as `section.key` -> value."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def dumps(data: Mapping[str, Any], prefix: str = "") -> str:
    """TOML text for `data`; None values are left out (TOML has no null)."""
    scalars: list[str] = []
    tables: list[str] = []
    for key, value in data.items():
        if value is None:
            continue
        name = _key(key)
        if isinstance(value, Mapping):
            path = f"{prefix}.{name}" if prefix else name
            body = dumps(value, path)
            tables.append(f"[{path}]\n{body}" if body else f"[{path}]\n")
        else:
            scalars.append(f"{name} = {_value(value)}\n")
    text = "".join(scalars)
    for table in tables:
        text += ("\n" if text else "") + table
    return text


def _key(key: str) -> str:
    bare = key and all(c.isalnum() or c in "_-" for c in key)
    return key if bare else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string for everything json.dumps escapes.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
