"""MiniBatch-SFL's step barrier: one server step per step index over the whole cohort.

At step i every cohort client still running sends its batch; the worker steps once on all of
them. A client is still running until it has been served a batch with `step + 1 >= steps`
(`steps` travels on every SmashedBatch). The barrier waits for every expected client; when the
oldest buffered batch has waited `timeout_s`, it steps with those present and stops waiting for
the missing ones for the rest of the round. Batches from clients it does not wait for (dropped,
or outside the cohort) join the next step that fires, or fire alone when nobody is expected, so
no client is left without an answer.

Pure bookkeeping: the caller supplies the cohort, each client's progress and the time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
Progress = Mapping[str, tuple[int, int]]  # client -> (last step applied, steps of its round)


def finished(progress: tuple[int, int] | None) -> bool:
    if progress is None:
        return False
    last, steps = progress
    return steps > 0 and last + 1 >= steps


class StepBarrier(Generic[T]):
    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._buffered: dict[str, deque[tuple[float, T]]] = {}
        self.dropped: set[str] = set()

    def new_round(self) -> None:
        self.dropped.clear()

    def add(self, client: str, item: T, now: float) -> None:
        self._buffered.setdefault(client, deque()).append((now, item))

    def __len__(self) -> int:
        return sum(len(q) for q in self._buffered.values())

    def expected(self, cohort: Mapping[str, int], progress: Progress) -> list[str]:
        return [c for c in cohort if c not in self.dropped and not finished(progress.get(c))]

    def ready(self, cohort: Mapping[str, int], progress: Progress) -> bool:
        if not self._buffered:
            return False
        return all(c in self._buffered for c in self.expected(cohort, progress))

    def deadline(self) -> float | None:
        if not self._buffered:
            return None
        return min(q[0][0] for q in self._buffered.values()) + self._timeout_s

    def expired(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def take(self, cohort: Mapping[str, int], progress: Progress) -> list[T]:
        """The oldest batch of every client with one (cohort order first); expected clients
        with none are dropped for the round."""
        missing = [c for c in self.expected(cohort, progress) if c not in self._buffered]
        self.dropped.update(missing)
        order = [c for c in cohort if c in self._buffered]
        order += [c for c in self._buffered if c not in cohort]
        taken = []
        for client in order:
            queue = self._buffered[client]
            taken.append(queue.popleft()[1])
            if not queue:
                del self._buffered[client]
        return taken

    def replace(self, match: Callable[[T], bool], new: Callable[[T], T]) -> T | None:
        """Swap the first buffered item that matches for `new(item)`; the old one, or None."""
        for queue in self._buffered.values():
            for index, (arrived, item) in enumerate(queue):
                if match(item):
                    queue[index] = (arrived, new(item))
                    return item
        return None

    def clear(self) -> None:
        """Forget every buffered batch (they return to the queue unacked)."""
        self._buffered.clear()
