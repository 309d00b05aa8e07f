"""Which round a client trains next (docs/async.md, "The protocol"): its Welcome picks the
clock. `Rounds`: a sync job's assignments, each round once; `Newest`: an async job's local
rounds; `Idle`: an async member with no training samples.
"""

from __future__ import annotations

import math
from dataclasses import replace

from broker.messages import Message, WeightsAssignment, Welcome


class Rounds:
    """Sync rounds: train each round a WeightsAssignment names, once."""

    patience_s = math.inf  # assignments come when the round opens: wait for them
    ask = False

    def __init__(self) -> None:
        self._last = -1
        # The assignment whose round this client dropped last (None: it uploaded that round).
        # The aggregator reopens a round that got no valid update with a new assignment for the
        # same round: a dropped round is tried again then, an uploaded one only if the upload
        # came after its round had closed (answered `round_closed`).
        self._dropped: str | None = None
        self._uploaded: str | None = None  # the assignment whose round was uploaded last

    def take(self, message: Message) -> WeightsAssignment | None:
        """The round to train that `message` hands out, or None."""
        if not isinstance(message, WeightsAssignment) or not message.participate:
            return None
        if message.round < self._last:
            return None
        retry = self._dropped is not None and message.message_id != self._dropped
        if message.round == self._last and not retry:
            return None  # a copy of an assignment already handled, or an uploaded round
        self._last = message.round
        return message

    def done(self, assignment: WeightsAssignment, *, uploaded: bool) -> None:
        self._dropped = None if uploaded else assignment.message_id
        self._uploaded = assignment.message_id if uploaded else None

    def closed_before_upload(self) -> None:
        """The aggregator answered an upload `round_closed`: it was not counted, so a reopened
        attempt at that round is tried again, as after a drop (were the answer about an older
        round, a later one is reopened only if no update of it counted: ours neither)."""
        if self._uploaded is not None:
            self._dropped, self._uploaded = self._uploaded, None


class Idle(Rounds):
    """Async mode for a member whose partition holds no training samples: it trains nothing and
    stays a member until dismissed (docs/async.md, "The protocol": why)."""

    def take(self, message: Message) -> WeightsAssignment | None:
        return None


class Newest:
    """Async mode (docs/async.md, "The protocol"): local rounds numbered by the client, never
    below an assignment's; one answers no real assignment, so its `RoundDropped` refers to none."""

    def __init__(self, patience_s: float) -> None:
        self.patience_s = patience_s  # for the answer to an upload: then ask again
        self.ask = False  # nothing was uploaded, so nothing will be answered unless we ask
        self._local = 0

    def take(self, message: Message) -> WeightsAssignment | None:
        if isinstance(message, Welcome):
            w = message
            message = WeightsAssignment(
                w.job, w.client, "", w.version, 0, True, w.client_weights, w.aux_weights, w.config
            )
        elif not isinstance(message, WeightsAssignment) or not message.participate:
            return None
        self._local = max(self._local, message.round)
        return replace(message, message_id="", round=self._local)

    def done(self, assignment: WeightsAssignment, *, uploaded: bool) -> None:
        self._local += 1
        self.ask = not uploaded


Clock = Rounds | Newest
