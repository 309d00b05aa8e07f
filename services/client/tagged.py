"""A client's logger: each line starts with its job and client."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class Tagged(logging.LoggerAdapter[logging.Logger]):
    """A client's logger: each line starts with its job and client."""

    def __init__(self, logger: logging.Logger, job: str, client: str) -> None:
        super().__init__(logger)
        self._tag = f"job {job} client {client}: "

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return self._tag + str(msg), kwargs
