"""Why a client stops or drops a round."""

from __future__ import annotations

from broker.errors import SplitMQError


class ClientError(SplitMQError):
    """The client cannot go on (no Welcome, no data partition, a batch the broker refuses...)."""


class ClientSettingsError(ClientError, ValueError):
    """The client was given an id or partition it cannot run with (a user's input, not a bug)."""


class JoinTimeoutError(ClientError):
    """No Welcome came back from the coordinator in time."""


class JoinRejectedError(ClientError):
    """The coordinator answered the Join with an Error."""


class ClientStopped(ClientError):
    """The stop event was set; raised from inside waits to unwind to `Client.run`."""


class RoundAborted(ClientError):
    """The current round cannot finish (error reply, superseded, bad gradient); the client
    drops it without publishing an update and waits for the next assignment."""


class Superseded(RoundAborted):
    """A newer assignment, or the job's end, arrived mid-round: the service has moved on, so
    the dropped round is not worth a `RoundDropped` notice."""


class StaleWeights(RoundAborted):
    """Async mode: a worker refused smashed data as too stale (GradientReply "rejected",
    "too_stale: ..."); the client drops the local round and fetches the newest weights."""
