"""Failures that are the user's to fix, and how to say each in one line.

A wrong URL, a server that is not running, a refused password, an unknown model or a bad
option are not bugs: a traceback only hides the one sentence that matters. Everything else is
a bug and keeps its traceback. The CLI's error boundary and the log formatter both ask here,
so a failure reads the same wherever it surfaces (`--debug` brings the tracebacks back).
"""

from __future__ import annotations

import sys

from broker.errors import (
    BrokerAuthError,
    BrokerUnavailableError,
    ConnectionSettingsError,
    StoreAuthError,
    StoreUnavailableError,
)
from services.config.loading import ConfigError
from services.data.errors import DataError

# What to do, by type (most specific first); the error's own text says what is wrong.
_HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (
        BrokerAuthError,
        "fix the user and password (or vhost) in broker.amqp_url / SPLITMQ_AMQP_URL; "
        "`rabbitmqctl authenticate_user USER PASSWORD` checks them",
    ),
    (
        BrokerUnavailableError,
        "start RabbitMQ or fix broker.amqp_url / SPLITMQ_AMQP_URL (`splitmq doctor` checks it)",
    ),
    (StoreAuthError, "fix the password in store.redis_url / SPLITMQ_REDIS_URL"),
    (
        StoreUnavailableError,
        "start Redis or fix store.redis_url / SPLITMQ_REDIS_URL (`splitmq doctor` checks it)",
    ),
)

_USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    ConnectionSettingsError,
    DataError,
    *(kind for kind, _ in _HINTS),
)

# User errors of packages that import torch (`models`, `services.client`), by module and name:
# such an error exists only once its module is imported, and the `splitmq check` healthcheck
# must not pay seconds of torch import just to classify its errors.
_LAZY_USER_ERRORS = (
    ("models.errors", "ModelError"),
    ("services.client.errors", "ClientSettingsError"),
    ("services.client.errors", "JoinTimeoutError"),
    ("services.client.errors", "JoinRejectedError"),
    ("services.client.inference", "InferenceError"),  # no answer, or a refused request
)


def _lazy_user_errors() -> tuple[type[BaseException], ...]:
    found = (getattr(sys.modules.get(module), name, None) for module, name in _LAZY_USER_ERRORS)
    return tuple(kind for kind in found if isinstance(kind, type) and issubclass(kind, Exception))


def user_message(exc: BaseException) -> str | None:
    """One line for a user error (what is wrong; what to do), None for anything else."""
    if not isinstance(exc, _USER_ERRORS + _lazy_user_errors()):
        return None
    text = " ".join(str(exc).split()) or type(exc).__name__
    hint = next((hint for kind, hint in _HINTS if isinstance(exc, kind)), "")
    return f"{text} -- {hint}" if hint else text
