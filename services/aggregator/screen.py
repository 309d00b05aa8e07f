"""What every update and drop notice must be, whatever state the round is in.

The inbox screens each message before any gate sees it: a message that fails here is
dead-lettered with its reason even when its round is long closed (a closed round would
otherwise answer it `round_closed`, or ack it as late, without looking). Only what holds for
every version of the job is checked here: the sender is a member, and an update's tensors
have the model's names, shapes and kinds (the model's structure never changes within a
job). Which round, version or cohort it belongs to is the gate's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.messages import RoundDropped, WeightsUpdate
from broker.store import WeightStore
from services.aggregator.gate import Reference, masks_problem, reference_of, weights_problem
from services.aggregator.members import MemberBook
from services.common.handout import WeightsCache


@dataclass(frozen=True)
class Refusal:
    reason: str
    kind: str  # counted per round attempt (`services.aggregator.empty`)
    member: bool  # whether it came from a member (its round came to nothing, async mode)


@dataclass(frozen=True)
class UpdateScreen:
    members: MemberBook
    client_ref: Reference
    aux_ref: Reference
    # A client may upload part of the client blob (FedSplitX: the blocks up to its level).
    partial_clients: bool = False

    @classmethod
    def of(
        cls, store: WeightStore, job: str, version: int, members: MemberBook, *, partial: bool
    ) -> UpdateScreen:
        """The screen of a job whose model is that of `version` (any published one)."""
        client, aux = WeightsCache(store, job, version).global_weights()
        return cls(members, reference_of(client), reference_of(aux), partial)

    def refusal(self, message: WeightsUpdate | RoundDropped) -> Refusal | None:
        if self.members.get(message.client) is None:
            reason = f"client {message.client!r} is not a member of the job"
            return Refusal(reason, "not_member", member=False)
        if isinstance(message, RoundDropped):
            return None
        if message.samples < 1:
            reason = "an update must report at least one training sample"
            return Refusal(reason, "no_samples", member=True)
        bad = (
            masks_problem(message.masks, message.client_weights)
            or weights_problem(
                message.client_weights,
                self.client_ref,
                "client_weights",
                subset=self.partial_clients,
            )
            or weights_problem(message.aux_weights, self.aux_ref, "aux_weights", subset=True)
        )
        return None if bad is None else Refusal(bad, "wrong_tensors", member=True)
