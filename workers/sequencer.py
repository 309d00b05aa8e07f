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
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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
        self._count = 0
        # Batches held (`len`): an attribute the worker's path reads without a call.
        self.held = 0
        self.skipped: set[str] = set()

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
                break
            self.skipped.add(turn)  # the others have waited long enough
            self.due_at = now + self._timeout_s  # the next turn's client gets a timeout too
        else:
            self.due_at = None  # nobody waits
        if self._after and not out and turn == "":
            turn = self._turn(cohort, progress)
        if (self._after or self._held) and (out or turn is None):
            out += self._unordered(cohort, progress)
        return out

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
