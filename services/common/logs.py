"""Logging for the `splitmq` processes: readable lines by default, JSON lines on request
(their fields: docs/deployment.md, "Structured logs").

Roles may pass context as `extra=`; a `ContextFilter` stamps process-wide fields (role, job) and
the current thread's `log_context` on every record. Configuration happens only at the process
edge (the CLI), inside `configured_logging`, which undoes itself on exit so repeated in-process
invocations (tests) do not stack handlers.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import ParamSpec, TextIO

from services.common.user_errors import user_message

CONTEXT_FIELDS = ("role", "job", "client", "worker", "shard", "version", "round", "seq")
# In every JSON line, null when unknown.
ALWAYS_FIELDS = frozenset({"job", "client", "shard", "version"})
HUMAN_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
HUMAN_DATEFMT = "%H:%M:%S"
# Chatty third-party loggers, kept at WARNING whatever our level is.
QUIET_LOGGERS = ("pika", "redis", "urllib3", "matplotlib", "PIL")

ContextValue = str | int | float
P = ParamSpec("P")

# Each thread starts with an empty context, so an embedded run's roles never see each other's.
_THREAD_CONTEXT: ContextVar[Mapping[str, ContextValue | None]] = ContextVar(
    "splitmq_log_context", default=MappingProxyType({})
)


@contextmanager
def log_context(**fields: ContextValue | None) -> Iterator[None]:
    """Stamp `fields` on every record this thread logs inside the block (None: unset)."""
    token = _THREAD_CONTEXT.set({**_THREAD_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _THREAD_CONTEXT.reset(token)


def in_log_context(
    fields: Mapping[str, ContextValue | None],
    act: Callable[P, None],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> None:
    """`act(*args, **kwargs)` inside `log_context(**fields)`, at the cost of one call: what a
    consumer does with each message."""
    token = _THREAD_CONTEXT.set({**_THREAD_CONTEXT.get(), **fields})
    try:
        act(*args, **kwargs)
    finally:
        _THREAD_CONTEXT.reset(token)


def fold_user_error(record: logging.LogRecord) -> logging.LogRecord:
    """`record` with a user error (`user_errors`) as the end of its message, not a traceback:
    "client of job j died: RabbitMQ unreachable at ... -- start RabbitMQ or fix ..."."""
    exc = record.exc_info[1] if record.exc_info else None
    message = user_message(exc) if exc is not None else None
    if message is None:
        return record
    folded = logging.makeLogRecord(record.__dict__)
    folded.msg, folded.args = f"{record.getMessage()}: {message}", None
    folded.exc_info = folded.exc_text = None
    return folded


class OneLineUserErrors(logging.Formatter):
    """`inner`'s format, with user errors folded into their line (`fold_user_error`)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self._inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return self._inner.format(fold_user_error(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, context fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None and value != "":
                obj[name] = value
            elif name in ALWAYS_FIELDS:
                obj[name] = None
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


class ContextFilter(logging.Filter):
    """Adds context fields to records that do not carry them already: the thread's
    `log_context` first, then the process-wide `fields`."""

    def __init__(self, fields: Mapping[str, ContextValue] | None = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})

    def filter(self, record: logging.LogRecord) -> bool:
        for source in (_THREAD_CONTEXT.get(), self._fields):
            for key, value in source.items():
                if value is not None and getattr(record, key, None) is None:
                    setattr(record, key, value)
        return True


class QuietPika(logging.Filter):
    """Drops pika's warnings for a returned (unroutable) or refused (nacked) publish, and unless
    `keep_errors` its ERROR records.

    `broker.rabbitmq` turns a return into `UnroutableError` and the caller decides: an event
    on the fanout with no subscriber is normal and dropped quietly, a lost reply is logged
    with its job and client. A nack is a full queue refusing the message (`BackPressureError`):
    the client backs off, retries and counts it (`back-pressure refusals` in its exit line).
    pika's own warning would repeat every one of them: thousands in a run held back by
    back-pressure (docs/reliability.md). A failed connection attempt logs six ERROR records
    and a traceback, every attempt; `broker.rabbitmq_channels` raises or warns once for it.
    """

    _DROPPED = ("Published message was returned", "Message was Nack'ed by broker")

    def __init__(self, *, keep_errors: bool = False) -> None:
        super().__init__()
        self._keep_errors = keep_errors

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("pika"):
            return True
        if str(record.msg).startswith(self._DROPPED):
            return False
        return self._keep_errors or record.levelno < logging.ERROR


@contextmanager
def configured_logging(
    level: str = "INFO",
    *,
    json_lines: bool = False,
    stream: TextIO | None = None,
    context: Mapping[str, ContextValue] | None = None,
    debug: bool = False,
) -> Iterator[logging.Handler]:
    """Route all logging to one handler at `level` for the duration of the block; user errors
    are one line unless `debug`, which also keeps pika's own error records."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    formatter = JsonFormatter() if json_lines else logging.Formatter(HUMAN_FORMAT, HUMAN_DATEFMT)
    handler.setFormatter(formatter if debug else OneLineUserErrors(formatter))
    handler.addFilter(QuietPika(keep_errors=debug))
    handler.addFilter(ContextFilter(context))
    quiet = [logging.getLogger(name) for name in QUIET_LOGGERS]
    saved = {logger: logger.level for logger in (root, *quiet)}
    root.addHandler(handler)
    root.setLevel(level)
    for q in quiet:
        q.setLevel(max(logging.WARNING, root.level))
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        for logger, saved_level in saved.items():
            logger.setLevel(saved_level)
        handler.flush()
