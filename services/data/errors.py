"""Errors raised by the data layer.

Each also derives from the builtin a caller would naturally catch (``FileNotFoundError``,
``ValueError``), so generic code keeps working while SplitMQ code can catch ``DataError``.
"""

from __future__ import annotations

from broker.errors import SplitMQError


class DataError(SplitMQError):
    """Base class of every data-layer error."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """The files a dataset needs are not where we looked; the message lists what was expected."""


class UnknownDatasetError(DataError, ValueError):
    """A dataset name that is not in the registry."""


class DataFormatError(DataError, ValueError):
    """A data file exists but its content is not what it should be (header, shape, dtype...)."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class PartitionError(DataError, ValueError):
    """A partition request that cannot be satisfied (too few samples, bad parameters...)."""
