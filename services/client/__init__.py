"""The edge client: joins a job, trains its local layers each round, uploads its update.

`Client(settings, backends, client_id=..., partition=...)`, then `run(stop) -> ClientStats`.
"""

from services.client.client import Client
from services.client.data import JobData
from services.client.errors import (
    ClientError,
    ClientStopped,
    JoinRejectedError,
    JoinTimeoutError,
    RoundAborted,
)
from services.client.stats import ClientStats

__all__ = [
    "Client",
    "ClientError",
    "ClientStats",
    "ClientStopped",
    "JobData",
    "JoinRejectedError",
    "JoinTimeoutError",
    "RoundAborted",
]
