"""Which seqs a client's session may use, so that no seq can lock a client out.

A client's session numbers its SmashedBatches contiguously from the `seq_base` of its Welcome,
which the coordinator keeps in its member record (`MemberInfo.seq_base`; 0: unknown, a record
from before sessions had one). A worker takes a batch only inside its session's window:

    seq_base <= seq <= top + credit

`top` is the highest seq taken (applied, or buffered to be) in the session, `seq_base - 1`
before any, and `credit` the client's allowance of batches per round (`workers.credit`): a
client's seqs run ahead of what the worker took by at most the batches it has in flight. A
record without `seq_base` has no window, as before sessions had one. A seq outside is refused
`bad_seq` and never recorded, so a forged seq far ahead cannot raise the floor that
`Replica.applied_already` keeps (a recorded copy below `seq_base`, from the client's previous
session, is still answered as a copy, before this check). A seq outside the known window may
be the first of a new session: the member record is read again (at most five times a second,
`MemberCache.info`), and the window moves to the new `seq_base`.

The same rule tells a genuine copy of an applied batch from a forgery: a copy carries the
message id of the batch it repeats (`copy_problem`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Rejection = tuple[str, str]
# The seq_base of a client (0: unknown); True: read the member record again first.
BaseLookup = Callable[[str, bool], int]


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
    return (
        "seq_reused",
        f"seq {seq} was taken from message {taken_id}; message {message_id} reuses it",
    )


@dataclass
class _Session:
    base: int
    top: int | None


class SessionSeqs:
    """Each client's current session window, from its member record (read through `lookup`)."""

    def __init__(self, lookup: BaseLookup) -> None:
        self._lookup = lookup
        self._sessions: dict[str, _Session] = {}

    def problem(self, client: str, seq: int, credit: int, applied: int | None) -> Rejection | None:
        """("bad_seq", why) when `seq` is outside `client`'s session window, else None.
        `applied`: the highest seq of the client the replica has applied (any session)."""
        session = self._sessions.get(client)
        if session is None:
            session = self._open(client, self._lookup(client, False), applied)
        why = window_problem(seq, session.base, session.top, credit)
        if why is None:
            return None
        base = self._lookup(client, True)
        if base != session.base:  # a new session
            session = self._open(client, base, applied)
            why = window_problem(seq, session.base, session.top, credit)
            if why is None:
                return None
        return "bad_seq", why

    def took(self, client: str, seq: int) -> None:
        """`seq` passed every check and is applied or buffered: the window moves up."""
        session = self._sessions.get(client)
        if session is not None and (session.top is None or seq > session.top):
            session.top = seq

    def forget(self) -> None:
        """Back to the replica's record (after a rollback to its checkpoint)."""
        self._sessions.clear()

    def _open(self, client: str, base: int, applied: int | None) -> _Session:
        top = applied if applied is not None and applied >= base else None
        if top is None and base:
            top = base - 1
        session = self._sessions[client] = _Session(base, top)
        return session
