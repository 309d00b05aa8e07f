"""A shard's per-client checks of a valid SmashedBatch (issue 33): one client must not cost
the others their training, by a flood or by its seqs. The rules and their measurements:
docs/reliability.md, "One client against the others on a shard queue".

**Credit.** A shard queue is one FIFO for every client of the shard and the round markers, so
whatever a client publishes is consumed ahead of what is queued behind it. The worker cannot
reorder the queue, but it can make a client's excess cheap: a client has at most `allowance`
batches accepted per round, and every batch beyond that is refused unjudged, dead-lettered
`over_budget` in batches (`Surplus`: one wait for the broker per half a prefetch), so a flood
drains at reject speed and never trains the replica. The allowance comes from the client's
assignment: the steps a client with its samples takes in a round (`round_steps`, the client's
own rule), twice over (the last round's stragglers come after the next RoundStart), plus
`SLACK`. A round is what lies between two RoundStarts (a reopened round counts afresh); in
async mode, which has no markers, the batches computed with one weights version (a client
trains one local round per version it fetched, two when no newer one was out yet), for the
versions not too stale to train on.

**Seqs.** A client's session numbers its SmashedBatches contiguously from the `seq_base` of
its Welcome, which the coordinator keeps in its member record (`MemberInfo.seq_base`). A worker
takes a batch only inside its session's window:

    seq_base <= seq <= top + allowance

`top` is the highest seq taken (applied, or buffered to be) in the session, `seq_base - 1`
before any: a client's seqs run ahead of what the worker took by at most the batches it has
in flight. A record without `seq_base` (0, written before sessions had one) has no window: such
a client numbers from its clock. A seq outside is refused `bad_seq` and never recorded, so a
forged seq far ahead cannot raise the floor that `Replica.applied_already` keeps (a recorded
copy below `seq_base`, from the client's previous session, is answered as a copy before this
check). A seq outside the known window may be a new session's first: the member record is read
again (once a second per client, `MemberCache.info`) and the window moves to its `seq_base`.
A copy of an applied or buffered batch carries that batch's message id; a message reusing its
seq under another id is refused `seq_reused` (`copy_problem`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from broker.messages import SmashedBatch
from broker.rejection import LetterBatch, Rejection
from broker.transport import Delivery
from workers.members import MemberCache
from workers.replica import Replica

# The seq_base of a client (0: unknown); True: read the member record again first.
BaseLookup = Callable[[str, bool], int]
# Batches beyond twice a round's steps a client may have accepted: a round reopened by a
# straggler's republish, a step barrier's redelivery after a take-over.
SLACK = 8
# The refused are dead-lettered once this many wait (the worker uses half its prefetch) or once
# the oldest has waited this long. Each settling is one synchronous wait for the broker's
# confirms, which on a busy host is mostly the scheduler's latency, paid by every client the
# worker serves; settling whenever the worker's wait for input ended empty (between two steps
# of a round) paid it dozens of times a round during a flood. Unsettled, they hold prefetch
# slots: at most half.
SURPLUS_BATCH = 8
SURPLUS_WAIT_S = 0.25


def round_steps(samples: int, *, batch_size: int, local_epochs: int, max_steps: int) -> int:
    """Steps of a client's round with `samples` training samples (`services.client.data`'s
    `round_batches`: whole epochs of ceil(samples / batch_size) batches, `max_steps` a cap)."""
    total = -(-max(0, samples) // batch_size) * local_epochs
    return min(total, max_steps) if max_steps else total


@dataclass(frozen=True)
class StepRule:
    """The job's step settings, which every client of the round shares."""

    batch_size: int
    local_epochs: int
    max_steps: int

    def allowance(self, samples: int) -> int:
        """Batches a client with `samples` samples may have accepted per round."""
        steps = round_steps(
            samples,
            batch_size=self.batch_size,
            local_epochs=self.local_epochs,
            max_steps=self.max_steps,
        )
        return 2 * steps + SLACK


@dataclass
class Credit:
    """Batches accepted per (client, round key) against their allowance."""

    _spent: dict[tuple[str, int], int] = field(default_factory=dict)

    def spend(self, client: str, key: int, allowance: int) -> bool:
        """Take one batch of `client`'s credit for round `key`; False when it has none left."""
        spent = self._spent.get((client, key), 0)
        if spent >= allowance:
            return False
        self._spent[(client, key)] = spent + 1
        return True

    def new_round(self) -> None:
        """A RoundStart: every client's count starts again."""
        self._spent.clear()

    def forget_before(self, key: int) -> None:
        """Async mode: the counts of versions too stale to train on go."""
        for stale in [k for k in self._spent if k[1] < key]:
            del self._spent[stale]


def window_problem(seq: int, base: int, top: int | None, credit: int) -> str | None:
    """Why `seq` lies outside `[base, top + credit]`, None when inside. Base 0 (a member record
    from before sessions had one) has no window: such a client numbers its batches from its
    clock, so a restarted process jumps ahead by its downtime in microseconds."""
    if not base:
        return None
    if seq < base:
        return f"seq {seq} is below its session's first seq {base}"
    if top is not None and seq > top + credit:
        return f"seq {seq} is beyond the session's highest seq taken {top} + credit {credit}"
    return None


def copy_problem(seq: int, message_id: str, recorded_id: str | None) -> Rejection | None:
    """A message reusing applied seq `seq` is a copy when it carries the applied batch's message
    id (a republish or a redelivery does); `recorded_id` None: not kept, taken for a copy."""
    if recorded_id is None or recorded_id == message_id:
        return None
    return reused(seq, message_id, recorded_id)


def reused(seq: int, message_id: str, taken_id: str) -> Rejection:
    """The refusal of message `message_id`, which reuses seq `seq` of message `taken_id`."""
    detail = f"seq {seq} was taken from message {taken_id}; message {message_id} reuses it"
    return Rejection("seq_reused", detail)


@dataclass
class _Session:
    base: int
    top: int | None


class SessionSeqs:
    """Each client's current session window, from its member record (read through `lookup`)."""

    def __init__(self, lookup: BaseLookup) -> None:
        self._lookup = lookup
        # By client; public for `ClientGate`, which moves a window up inline.
        self.sessions: dict[str, _Session] = {}

    def problem(self, client: str, seq: int, credit: int, applied: int | None) -> Rejection | None:
        """A `bad_seq` rejection when `seq` is outside `client`'s session window, else None.
        `applied`: the highest seq of the client the replica has applied (any session)."""
        session = self.sessions.get(client)
        if session is None:
            session = self._open(client, self._lookup(client, False), applied)
        base, top = session.base, session.top
        # `window_problem`'s own test, inline: every batch passes here.
        if not base or (seq >= base and (top is None or seq <= top + credit)):
            return None
        why = window_problem(seq, base, top, credit)
        if why is None:
            return None
        base = self._lookup(client, True)
        if base != session.base:  # a new session
            session = self._open(client, base, applied)
            why = window_problem(seq, session.base, session.top, credit)
            if why is None:
                return None
        return Rejection("bad_seq", why)

    def took(self, client: str, seq: int) -> None:
        """`seq` passed every check and is applied or buffered: the window moves up."""
        session = self.sessions.get(client)
        if session is not None and (session.top is None or seq > session.top):
            session.top = seq

    def forget(self) -> None:
        """Back to the replica's record (after a rollback to its checkpoint)."""
        self.sessions.clear()

    def _open(self, client: str, base: int, applied: int | None) -> _Session:
        top = applied if applied is not None and applied >= base else None
        if top is None and base:
            top = base - 1
        session = self.sessions[client] = _Session(base, top)
        return session


@dataclass(eq=False)
class ClientGate:
    rule: StepRule
    members: MemberCache
    replica: Replica
    # Async mode: a round is the batches computed with one version (no RoundStarts to count by).
    by_version: bool = False
    _credit: Credit = field(default_factory=Credit)
    _seqs: SessionSeqs = field(init=False)
    # The round's allowance of each cohort member: its samples are fixed until the next round.
    _allowances: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._seqs = SessionSeqs(self._seq_base)

    def allowance(self, client: str) -> int:
        """Batches `client` may have accepted per round: from its samples in the round's cohort
        (the aggregator's word, kept for the round), else in its member record (read each
        time: it may change); 0 samples (never in a cohort, or gone) still leave `SLACK`."""
        samples = self.replica.cohort.get(client)
        if samples is not None:
            allowance = self._allowances[client] = self.rule.allowance(samples)
            return allowance
        info = self.members.info(client)
        return self.rule.allowance(info.samples if info is not None else 0)

    def seq_problem(self, batch: SmashedBatch) -> Rejection | None:
        client, seq = batch.client, batch.seq
        credit = self._allowances.get(client) or self.allowance(client)
        session = self._seqs.sessions.get(client)
        # Inside a known window (`SessionSeqs.problem`'s first answer): every batch but a
        # session's first.
        if session is not None and (
            not session.base
            or (seq >= session.base and (session.top is None or seq <= session.top + credit))
        ):
            return None
        return self._seqs.problem(client, seq, credit, self.replica.seqs.get(client))

    def take(self, batch: SmashedBatch) -> Rejection | None:
        """Spend a batch of its client's credit and move its seq window up (`batch` passed
        every other check and is applied or buffered); when no credit is left, why `batch` is
        refused unjudged."""
        client = batch.client
        allowance = self._allowances.get(client) or self.allowance(client)
        key = batch.version if self.by_version else 0
        if not self._credit.spend(client, key, allowance):
            per = f"computed with version {batch.version}" if self.by_version else "this round"
            detail = f"client {client!r} has had {allowance} batches {per}, its allowance"
            return Rejection("over_budget", f"{detail}; refused unjudged")
        # `SessionSeqs.took`, inline.
        session, seq = self._seqs.sessions.get(client), batch.seq
        if session is not None and (session.top is None or seq > session.top):
            session.top = seq
        return None

    def new_round(self) -> None:
        """A RoundStart: a new cohort, every client's count starts again."""
        self._credit.new_round()
        self._allowances.clear()

    def forget_versions_before(self, version: int) -> None:
        self._credit.forget_before(version)

    def reset(self) -> None:
        """The replica went back to its checkpoint: what it took since comes again."""
        self._credit.new_round()
        self._allowances.clear()
        self._seqs.forget()

    def _seq_base(self, client: str, again: bool) -> int:
        info = self.members.info(client, again=again)
        return info.seq_base if info is not None else 0


@dataclass
class Surplus(LetterBatch):
    """The worker's refusals waiting to be dead-lettered together, and how often each reason
    code may be logged."""

    size: int = SURPLUS_BATCH
    wait_s: float = SURPLUS_WAIT_S
    # Per reason code: when it was last logged, and the refusals since.
    _unlogged: dict[str, tuple[float, int]] = field(default_factory=dict)

    def take(self) -> list[tuple[Delivery, str]]:
        return self.take_letters()

    def settled(self, code: str) -> int:
        """Count one dead letter of `code`; how many to log now: those since the last line of
        that code, at most one line a second (a flood would write one per message)."""
        now = self.clock()
        logged_at, since = self._unlogged.get(code, (float("-inf"), 0))
        since += 1
        if now - logged_at < 1.0:
            self._unlogged[code] = (logged_at, since)
            return 0
        self._unlogged[code] = (now, 0)
        return since
