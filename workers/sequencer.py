"""A sync round's canonical order for a shard that steps on batches one by one (issue 36).

With `job.deterministic`, a non-barrier algorithm's shard serves a round's batches in one order
whatever order they arrive in: round-robin over the cohort in cohort order (the RoundStart's
participants order), each client's batches in their step order. That is the order of the key
(step, place in the cohort): every client's step 0 in cohort order, then every step 1, and so
on; a client that has finished its round (its `steps` reached) drops out of the rotation, so
clients with fewer steps than others never hold the rest up. The turn is derived from each
client's last step served (the replica's `progress`, or what was released since), not from a
cursor: a successor that restores the replica's checkpoint resumes the same rotation.

It must not hang: when the client whose turn it is has sent nothing for `timeout_s` while
others wait, or the sequencer holds as many batches as the worker may hold unacked (`limit`),
it is skipped for the rest of the round (as `workers.barrier` drops a client),
and `settle` (RoundEnd, a version change) gives everything held, in canonical order. Batches it
does not order (clients outside the cohort, another round's, skipped or finished clients')
follow the next release, or go at once when nobody is expected.

Pure bookkeeping: the caller supplies the cohort, each client's progress and the time.

A replay serves its run's recorded order instead (`RecordedOrder`, same interface).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.common.schedule import BatchKey
from workers.barrier import Progress, finished

T = TypeVar("T")


@dataclass(order=True)
class _Held(Generic[T]):
    """One batch waiting for its turn; ordered by step, then arrival (`order`)."""

    step: int
    order: int
    steps: int = field(compare=False)
    item: T = field(compare=False)


class Sequencer(Generic[T]):
    def __init__(self, timeout_s: float, limit: int = 1 << 30) -> None:
        """`limit`: batches it may hold at most. A worker's prefetch is finite: once it holds
        that many, the turn's batch may be unable to reach it, so it stops waiting for it at
        once, as after the timeout (the only case, with the timeout, where time decides)."""
        self._timeout_s = timeout_s
        self._limit = limit
        self._held: dict[str, list[_Held[T]]] = {}  # cohort clients' batches of the round
        self._after: list[T] = []  # batches it does not order, in arrival order
        self._released: dict[str, tuple[int, int]] = {}  # (step, steps) last released, per client
        # When the client whose turn it is will be skipped; None while nobody waits for it. An
        # attribute, not a method: the worker's loop reads it after every delivery.
        self.due_at: float | None = None
        # The client whose turn it is while the others wait for it (None: nobody waits): the
        # runner skips it at once when it is no member any more (it left; no timeout needed).
        self.waiting_for: str | None = None
        self._count = 0
        # Batches held (`len`): an attribute the worker's path reads without a call.
        self.held = 0
        self.skipped: set[str] = set()
        # Batches to answer without applying them: never any here (`RecordedOrder`'s are).
        self.refused: list[T] = []

    def new_round(self) -> None:
        self.skipped.clear()
        self._released.clear()
        self.due_at = None

    def add(self, client: str, step: int, steps: int, item: T, *, ordered: bool) -> None:
        """`ordered`: a batch of the current round from a cohort client (the caller knows the
        round); any other goes after the ordered ones."""
        self.held += 1
        if not ordered:
            self._after.append(item)
            return
        self._count += 1
        bisect.insort(self._held.setdefault(client, []), _Held(step, self._count, steps, item))

    def offer(
        self,
        client: str,
        step: int,
        steps: int,
        item: T,
        ordered: bool,
        cohort: Mapping[str, int],
        progress: Progress,
        now: float,
    ) -> list[T]:
        """`add` then `take`, in one call: every batch of the worker's path makes it."""
        self.held += 1
        if ordered:
            self._count += 1
            bisect.insort(self._held.setdefault(client, []), _Held(step, self._count, steps, item))
        else:
            self._after.append(item)
        return self.take(cohort, progress, now)

    def __len__(self) -> int:
        return self.held

    def take(self, cohort: Mapping[str, int], progress: Progress, now: float) -> list[T]:
        """What may be served now, in order: each turn's batch while its client has sent it,
        then (when anything was released, or nobody is expected) the batches it does not
        order. A turn's client that keeps the others waiting past the timeout is skipped.
        Every batch of the path calls it: few calls, nothing computed twice."""
        out: list[T] = []
        turn: str | None = ""  # "": not asked
        while self._held:
            turn = self._turn(cohort, progress)
            if turn is None:
                break
            queue = self._held.get(turn)
            if queue:  # `_pop`, inline: once a batch
                held = queue.pop(0)
                if not queue:
                    del self._held[turn]
                self.held -= 1
                last = self._released.get(turn)
                if last is None or held.step >= last[0]:
                    self._released[turn] = (held.step, held.steps)
                out.append(held.item)
                self.due_at = None
                continue
            if self.due_at is None:
                self.due_at = now + self._timeout_s
            if now < self.due_at and self.held < self._limit:
                self.waiting_for = turn
                break
            self.skipped.add(turn)  # the others have waited long enough
            self.due_at = now + self._timeout_s  # the next turn's client gets a timeout too
        else:
            self.due_at = None  # nobody waits
        if self.due_at is None:
            self.waiting_for = None
        if self._after and not out and turn == "":
            turn = self._turn(cohort, progress)
        if (self._after or self._held) and (out or turn is None):
            out += self._unordered(cohort, progress)
        return out

    def skip(self, client: str) -> None:
        """Stop waiting for `client` for the rest of the round (it left the job): its turns go
        to the next client at the next `take`."""
        self.skipped.add(client)

    def settle(self, cohort: Mapping[str, int], progress: Progress) -> list[T]:
        """Everything held, in canonical order (skipped clients' in turn too: the round is
        over, no one waits any more), then the batches it does not order."""
        place = {client: i for i, client in enumerate(cohort)}
        rest = [
            (h.step, place.get(c, len(place)), h.order, c) for c, q in self._held.items() for h in q
        ]
        out = [self._pop(c, self._held[c]) for *_, c in sorted(rest)]
        out += self._after
        self.held -= len(self._after)
        self._after = []
        self.due_at = None
        return out

    def replace(self, match: Callable[[T], bool], new: Callable[[T], T]) -> T | None:
        """Swap the first held item that matches for `new(item)`; the old one, or None."""
        for queue in self._held.values():
            for held in queue:
                if match(held.item):
                    old, held.item = held.item, new(held.item)
                    return old
        for index, item in enumerate(self._after):
            if match(item):
                self._after[index] = new(item)
                return item
        return None

    def clear(self) -> None:
        """Forget every held batch (they return to the queue unacked) and where the round
        stood: a rolled-back replica's progress says it again."""
        self._held.clear()
        self._after.clear()
        self.held = 0
        self._released.clear()
        self.due_at = None

    # --- the turn -----------------------------------------------------------------------------
    def _last(self, client: str, progress: Progress) -> tuple[int, int] | None:
        """The client's last (step, steps) served this round: released here, or applied by
        the replica (a restored checkpoint's)."""
        mine, theirs = self._released.get(client), progress.get(client)
        if mine is None or theirs is None:
            return mine or theirs
        return max(mine, theirs)

    def _expected(self, client: str, progress: Progress) -> bool:
        return client not in self.skipped and not finished(self._last(client, progress))

    def _turn(self, cohort: Mapping[str, int], progress: Progress) -> str | None:
        """The expected client with the smallest (next step, place in the cohort): its next
        step is the lowest it holds, else the one after its last served. `_last` and
        `finished` inline: it runs once a batch for every cohort client."""
        best, turn = 0, None
        held, released, skipped = self._held, self._released, self.skipped
        for client in cohort:  # in cohort order: a tie goes to the earlier client
            if client in skipped:
                continue
            mine, theirs = released.get(client), progress.get(client)
            last = theirs if mine is None else mine if theirs is None else max(mine, theirs)
            if last is not None and last[1] > 0 and last[0] + 1 >= last[1]:
                continue  # finished its round
            queue = held.get(client)
            step = queue[0].step if queue else 0 if last is None else last[0] + 1
            if turn is None or step < best:
                best, turn = step, client
        return turn

    def _pop(self, client: str, queue: list[_Held[T]]) -> T:
        self.held -= 1
        held = queue.pop(0)
        if not queue:
            del self._held[client]
        last = self._released.get(client)
        if last is None or held.step >= last[0]:
            self._released[client] = (held.step, held.steps)
        return held.item

    def _unordered(self, cohort: Mapping[str, int], progress: Progress) -> list[T]:
        """Held batches of cohort clients no longer expected (cohort order), then the others."""
        out: list[T] = []
        for client in cohort:
            queue = self._held.get(client)
            while queue and not self._expected(client, progress):
                out.append(self._pop(client, queue))
                queue = self._held.get(client)
        out += self._after
        self.held -= len(self._after)
        self._after = []
        return out


class RecordedOrder(Generic[T]):
    """A replay's order (`splitmq replay`, issue 36): a shard serves its batches in the order
    the run recorded, whatever order they arrive in, so a free-running run (batches served as
    they came) is re-executed exactly. Same interface as `Sequencer`: the runner holds either.

    The turn is the next (client, round, step) of the shard's effective history
    (`services.common.schedule.shard_history`: a take-over's lost batches cut), from the
    replica's applied count (`position`: a rollback's restored replica resumes the record
    where its checkpoint stood). No timeout: the record says who was skipped, and a client
    whose batch is not recorded simply never gets a turn. What happens to the others:

    - a batch of a round within the record that the record lacks was never applied by the run
      (its client left, or the run ended first): it is never served, and the runner answers
      it "rejected" at once (`refused`), so its client ends the round as the run's did;
    - a batch of a round past the record's last one (a record that ends early): canonical
      order (`Sequencer`, timeout included) from there, said once;
    - a recorded turn that never comes must not stop the replay: at a settle (round marker,
      version change) a turn of a round before the newest one seen is given up, and so is the
      turn when the batches held fill what the worker may hold unacked (`limit`: the turn's
      batch could not reach it); each said, and the replay's record shows the departure.
    """

    def __init__(
        self,
        batches: Sequence[BatchKey],
        key: Callable[[T], BatchKey],
        position: Callable[[], int],
        timeout_s: float,
        limit: int = 1 << 30,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """`key`: an item's (client, round, step); `position`: the replica's applied count."""
        self._record = tuple(batches)
        self._at = {k: i for i, k in enumerate(self._record)}  # a key's (last) place
        self._last_round = max((k[1] for k in self._record), default=-1)
        self._key, self._position, self._limit = key, position, limit
        self._say = say or (lambda _: None)
        self._cursor: int | None = None  # None: read it from `position` when next needed
        self._held: dict[BatchKey, list[T]] = {}
        self._count = 0  # items in `_held`
        self._round = -1  # the newest round of a batch offered
        self._beyond: Sequencer[T] = Sequencer(timeout_s, limit)  # rounds past the record
        self._said_beyond = False
        self.given_up: list[BatchKey] = []  # recorded turns that never came
        self.unrecorded: list[BatchKey] = []  # refused: never to be served
        # Unrecorded batches for the runner to answer "rejected" now (and never apply), so
        # their client ends its round at once, as the run's did (it had left): a held batch
        # would keep it waiting for a gradient through all its resends.
        self.refused: list[T] = []
        self.due_at: float | None = None
        self.waiting_for: str | None = None  # the canonical order's, past the record
        self.held = 0

    @property
    def skipped(self) -> set[str]:
        return self._beyond.skipped

    def skip(self, client: str) -> None:
        self._beyond.skip(client)

    def __len__(self) -> int:
        return self.held

    def new_round(self) -> None:
        self._beyond.new_round()

    def add(self, client: str, step: int, steps: int, item: T, *, ordered: bool) -> None:
        k = self._key(item)
        self._round = max(self._round, k[1])
        if k[1] > self._last_round:
            if not self._said_beyond:
                self._said_beyond = True
                self._say(
                    f"round {k[1] + 1} is past the record (it ends with round "
                    f"{self._last_round + 1}): canonical order from here"
                )
            self._beyond.add(client, step, steps, item, ordered=ordered)
        else:
            if self._at.get(k, -1) < self._cursor_now():
                self.unrecorded.append(k)
                self._say(
                    f"{k[0]} round {k[1] + 1} step {k[2]} is not in the rest of the record "
                    "(the run never applied it there): answered, not applied"
                )
                self.refused.append(item)
            else:
                self._held.setdefault(k, []).append(item)
                self._count += 1
        self._sync()

    def offer(
        self,
        client: str,
        step: int,
        steps: int,
        item: T,
        ordered: bool,
        cohort: Mapping[str, int],
        progress: Progress,
        now: float,
    ) -> list[T]:
        self.add(client, step, steps, item, ordered=ordered)
        return self.take(cohort, progress, now)

    def take(self, cohort: Mapping[str, int], progress: Progress, now: float) -> list[T]:
        out = self._serve(settling=False)
        if self._beyond.held:
            out += self._beyond.take(cohort, progress, now)
        self._sync()
        return out

    def settle(self, cohort: Mapping[str, int], progress: Progress) -> list[T]:
        """The record's turns that are held; the batches it has later turns for (or none) stay
        held (the runner's settle stops when only those are left)."""
        out = self._serve(settling=True)
        out += self._beyond.settle(cohort, progress)
        self._sync()
        return out

    def replace(self, match: Callable[[T], bool], new: Callable[[T], T]) -> T | None:
        for queue in self._held.values():
            for index, item in enumerate(queue):
                if match(item):
                    queue[index] = new(item)
                    return item
        return self._beyond.replace(match, new)

    def clear(self) -> None:
        """Forget what is held; the turn is read again from the (restored) replica's count."""
        self._held.clear()
        self._count = 0
        self._cursor = None
        self._beyond.clear()
        self._sync()

    def _cursor_now(self) -> int:
        if self._cursor is None:
            self._cursor = self._position()
        return self._cursor

    def _serve(self, *, settling: bool) -> list[T]:
        """Each turn's batch while it is held; a turn given up as the class says."""
        out: list[T] = []
        record, held, cursor = self._record, self._held, self._cursor_now()
        while cursor < len(record):
            turn = record[cursor]
            queue = held.get(turn)
            if queue:
                out.append(queue.pop(0))
                if not queue:
                    del held[turn]
                self._count -= 1
                cursor += 1
                continue
            stale = settling and turn[1] < self._round
            if not stale and self._count < self._limit:
                break
            self.given_up.append(turn)
            why = "its round is over" if stale else f"{self._count} batches are held"
            self._say(
                f"the record's batch {turn[0]} round {turn[1] + 1} step {turn[2]} never came "
                f"({why}): the replay goes on without it"
            )
            cursor += 1
        self._cursor = cursor
        return out

    def _sync(self) -> None:
        """The attributes the runner reads without a call."""
        self.held = self._count + self._beyond.held
        self.due_at = self._beyond.due_at
        self.waiting_for = self._beyond.waiting_for
