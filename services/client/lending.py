"""What a client holds only while it trains: a model, and its algorithm's memory.

A client's weights come with every assignment (`services.common.handout`) and its optimizer
lives for one round (`services.algorithms`), so between rounds a client needs neither a model
nor optimizer state: only the algorithm's per-client tensors (`ClientContext.memory`). A
standalone client keeps one model and its memory in RAM (`OwnModel`, `KeptMemory`); a client
host (`services.client.host`) lends models from a pool to the clients that are training and
can spill idle clients' memory to disk (`SpilledMemory`), so its RAM grows with the clients
training at once, not with the clients it runs (docs/architecture.md, "Client hosts").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from broker.transport import Broker
from models.split import SplitNet
from services.client.beat import StartBeats

Tensors = dict[str, torch.Tensor]


class Models(Protocol):
    """Where a client gets the model it trains a round with."""

    @property
    def reference(self) -> SplitNet:
        """A model of the job's shape, to check received weights against; never trained."""

    def borrow(self) -> AbstractContextManager[SplitNet]:
        """A model for one round; whatever it held before is overwritten by the round's
        weights (every part a client trains comes with its assignment)."""


class OwnModel:
    """A standalone client's one model."""

    def __init__(self, model: SplitNet) -> None:
        self._model = model

    @property
    def reference(self) -> SplitNet:
        return self._model

    @contextmanager
    def borrow(self) -> Iterator[SplitNet]:
        yield self._model


class ModelPool:
    """Models lent to whichever clients train now: as many are built as train at once (a
    step barrier such as MiniBatch-SFL's needs the whole cohort training together, so the
    pool has no cap), and a returned one waits for the next borrower."""

    def __init__(self, build: Callable[[], SplitNet]) -> None:
        self._build = build
        self._free: list[SplitNet] = []
        self._lock = threading.Lock()
        self.built = 0
        self._reference = build()

    @property
    def reference(self) -> SplitNet:
        return self._reference

    @contextmanager
    def borrow(self) -> Iterator[SplitNet]:
        with self._lock:
            model = self._free.pop() if self._free else None
        if model is None:
            model = self._build()
            with self._lock:
                self.built += 1
        try:
            yield model
        finally:
            # Gradients are the size of the trainable part: not worth keeping while idle.
            model.zero_grad(set_to_none=True)
            with self._lock:
                self._free.append(model)


class ComputeGate:
    """At most `slots` clients of a host at a time in work that waits on nothing (a
    whole-model round, a local evaluation), so what that work holds at its peak (activations,
    a test chunk) is bounded by the slots, not by the cohort. A split round's steps wait on
    the broker and are not gated: a step barrier (MiniBatch-SFL) needs the whole cohort
    training at once. Reentrant within a thread; `None` slots: no limit (a standalone client)."""

    def __init__(self, slots: int | None = None) -> None:
        if slots is not None and slots < 1:
            raise ValueError(f"compute slots must be >= 1, got {slots}")
        self._slots = None if slots is None else threading.BoundedSemaphore(slots)
        self._depth = threading.local()

    @contextmanager
    def held(self) -> Iterator[None]:
        depth: int = getattr(self._depth, "n", 0)
        slots = self._slots if depth == 0 else None  # a nested hold has its slot already
        if slots is not None:
            slots.acquire()
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if slots is not None:
                slots.release()


class Memory(Protocol):
    """One client's algorithm memory between its rounds, with the algorithm it belongs to."""

    def take(self) -> tuple[str, Tensors]: ...

    def put(self, algorithm: str, tensors: Tensors) -> None: ...


class KeptMemory:
    """In RAM, as the algorithm left it."""

    def __init__(self) -> None:
        self._algorithm = ""
        self._tensors: Tensors = {}

    def take(self) -> tuple[str, Tensors]:
        return self._algorithm, self._tensors

    def put(self, algorithm: str, tensors: Tensors) -> None:
        self._algorithm, self._tensors = algorithm, tensors


class SpilledMemory:
    """On disk between rounds (safetensors; the algorithm's name in its metadata), so an idle
    client costs no RAM for it; nothing is written while the memory is empty."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def take(self) -> tuple[str, Tensors]:
        if not self._path.exists():
            return "", {}
        with safe_open(str(self._path), framework="pt") as f:
            algorithm = (f.metadata() or {}).get("algorithm", "")
            return algorithm, {name: f.get_tensor(name) for name in f.keys()}

    def put(self, algorithm: str, tensors: Tensors) -> None:
        if not tensors:
            self._path.unlink(missing_ok=True)
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        partial = self._path.with_suffix(".partial")
        # Copies: safetensors refuses tensors that share storage, which views in a memory may.
        copies = {name: t.detach().clone() for name, t in tensors.items()}
        save_file(copies, partial, metadata={"algorithm": algorithm})
        partial.replace(self._path)


@dataclass(frozen=True)
class Seat:
    """What a client host lends one of its clients for one online session: a broker handle
    fed from the host's reply queue and publishing over the host's connections, a seat in the
    host's batched heartbeats, models from its pool, the client's memory (which outlives the
    session, as a device's storage outlives its app), and what its Joins add to their info
    (the host's id, for the coordinator's binding)."""

    broker: Broker
    heartbeats: StartBeats
    models: Models
    memory: Memory
    join_info: Mapping[str, str]
    compute: ComputeGate
