"""A shard's per-client checks of a valid SmashedBatch: its session's seq window
(`workers.seqs`) and its round's credit (`workers.credit`), both sized by the client's
allowance of batches per round."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.messages import SmashedBatch
from workers.credit import Credit, StepRule
from workers.members import MemberCache
from workers.replica import Replica
from workers.seqs import Rejection, SessionSeqs


@dataclass(eq=False)
class ClientGate:
    rule: StepRule
    members: MemberCache
    replica: Replica
    # Async mode: a round is the batches computed with one version (no RoundStarts to count by).
    by_version: bool = False
    _credit: Credit = field(default_factory=Credit)
    _seqs: SessionSeqs = field(init=False)

    def __post_init__(self) -> None:
        self._seqs = SessionSeqs(self._seq_base)

    def allowance(self, client: str) -> int:
        """Batches `client` may have accepted per round: from its samples in the round's cohort
        (the aggregator's word), else in its member record; 0 samples (never in a cohort, or
        gone) still leave `SLACK`."""
        samples = self.replica.cohort.get(client)
        if samples is None:
            info = self.members.info(client)
            samples = info.samples if info is not None else 0
        return self.rule.allowance(samples)

    def seq_problem(self, batch: SmashedBatch) -> Rejection | None:
        credit = self.allowance(batch.client)
        applied = self.replica.seqs.get(batch.client)
        return self._seqs.problem(batch.client, batch.seq, credit, applied)

    def over_budget(self, batch: SmashedBatch) -> str | None:
        """The reason to refuse `batch` unjudged when its client has no credit left, else None
        (one batch of credit spent)."""
        allowance = self.allowance(batch.client)
        key = batch.version if self.by_version else 0
        if self._credit.spend(batch.client, key, allowance):
            return None
        per = f"computed with version {batch.version}" if self.by_version else "this round"
        return (
            f"over_budget: client {batch.client!r} has had {allowance} batches {per}, its "
            "allowance; refused unjudged"
        )

    def took(self, batch: SmashedBatch) -> None:
        self._seqs.took(batch.client, batch.seq)

    def new_round(self) -> None:
        self._credit.new_round()

    def forget_versions_before(self, version: int) -> None:
        self._credit.forget_before(version)

    def reset(self) -> None:
        """The replica went back to its checkpoint: what it took since comes again."""
        self._credit.new_round()
        self._seqs.forget()

    def _seq_base(self, client: str, again: bool) -> int:
        info = self.members.info(client, again=again)
        return info.seq_base if info is not None else 0
