"""One shard's replica of the server-side model, and the bookkeeping its checkpoint carries.

The checkpoint's `meta` fields the aggregator reads are docs/architecture.md's ("Weights and
versions"). We add `steps` (optimizer steps), the current round's `cohort` with its round
(`cohort_round`) and each cohort client's `progress` ([last step applied, steps]), so a
MiniBatch-SFL barrier resumed on another worker knows whom to wait for, and `audit`: per
client, [batches applied, sum of their seqs mod 2^61], from which `benchmarks/soak.py` proves
every batch sent was applied exactly once across failovers. The optimizer's state (momentum,
Adam's moments and step) travels in `Checkpoint.optimizer`, with its class in `optimizer` and
the entries that were Python numbers in `optimizer_numbers`: a successor steps on exactly as
the replica would have.
"""

from __future__ import annotations

import bisect
import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from broker.errors import VersionNotFoundError
from broker.store import SERVER_PART, BlobRef, Checkpoint, VersionStore, WeightStore
from models.parts import ServerModel
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.recipe import load_optimizer_state, optimizer_state

SERVER = BlobRef(SERVER_PART)
# Seq sums are kept modulo this (seqs start at the client's clock in microseconds).
AUDIT_MODULUS = 1 << 61
# How many of a client's latest applied seqs a replica keeps apart (checkpoint included),
# above a floor at or below which every seq counts as applied: more than the batches of one
# client that can be applied between one it was handed back and that one's return.
RECENT_SEQS = 64
ModelFactory = Callable[[], SplitNet]


class OptimizerFactory(Protocol):
    """A fresh server optimizer for the replica of `version` after `steps` optimizer steps
    (`Hyper.server_optimizer`: where its schedule stands)."""

    def __call__(
        self, params: Iterable[nn.Parameter], *, version: int, steps: int
    ) -> torch.optim.Optimizer: ...


def pick_device(setting: str, *, cuda_available: Callable[[], bool] | None = None) -> torch.device:
    """`auto` is CUDA when present, else the CPU; asking for CUDA without one is an error."""
    available = (cuda_available or torch.cuda.is_available)()
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" and not available:
        raise ValueError("workers.device = 'cuda' but no CUDA device is available")
    return torch.device("cuda" if available else "cpu")


class Replica:
    """Server-side blocks of one shard on `device`, with an optimizer and progress counters."""

    def __init__(
        self,
        shard: int,
        template: SplitNet,
        cut: str,
        optimizer_factory: OptimizerFactory,
        device: torch.device,
    ) -> None:
        self.shard = shard
        self.cut = cut
        # A private copy: replicas of several shards must not share parameters.
        self.server: nn.Module = ServerModel(copy.deepcopy(template), cut).to(device)
        self.server.train()
        self._optimizer_factory = optimizer_factory
        self._names: frozenset[str] = frozenset(self.server.state_dict())
        self.origin_version = 0  # what a replica without checkpoint started from
        self.from_checkpoint = False  # restored from a checkpoint: the schedule records it
        self._clear()
        self.optimizer = self._fresh_optimizer()

    def _clear(self) -> None:
        self.version = 0
        self.applied = 0
        self.steps = 0
        self.round = -1
        self.round_samples = 0
        self.cut_samples: dict[str, int] = {}  # round_samples by the cut the batches came from
        self.handed_in = False  # round_samples were handed in with `round`; restart counting
        self.seqs: dict[str, int] = {}  # the highest seq applied, per client
        # Which seqs are applied, per client: all up to its floor, and those in its window.
        self.floors: dict[str, int] = {}
        self.recent: dict[str, list[int]] = {}  # sorted, above the floor, at most RECENT_SEQS
        # The message id each recent seq was applied from: a copy carries it, a forgery reusing
        # the seq does not (`workers.gate.copy_problem`). Absent in checkpoints from before.
        self.recent_ids: dict[str, dict[int, str]] = {}
        self.cohort_round = -1
        self.cohort: dict[str, int] = {}
        self.progress: dict[str, tuple[int, int]] = {}
        self.audit: dict[str, tuple[int, int]] = {}

    # --- loading ------------------------------------------------------------------------------
    def load_version(self, store: VersionStore, job: str, version: int) -> None:
        """Weights of `server/global` at `version`; a new version is a new model, so the
        optimizer state starts afresh (architecture doc, "Weights and versions")."""
        self._load(store.read_blob(job, version, SERVER))
        self.version = version
        self.optimizer = self._fresh_optimizer()

    def restore(self, checkpoint: Checkpoint) -> None:
        """Weights, optimizer state and bookkeeping of a checkpoint (raises `StateDictError`
        on foreign weights). A checkpoint without optimizer state, or with another optimizer's,
        gets a fresh optimizer."""
        self._load(checkpoint.weights)
        self._clear()
        self.from_checkpoint = True
        self.applied = int(checkpoint.applied)
        for key, check in _META.items():  # a field the checkpoint lacks keeps its default
            if key in checkpoint.meta:
                setattr(self, key, check(key, checkpoint.meta[key]))
        if checkpoint.meta.get("handed_in") is True:
            self.start_counting()
        if "floors" not in checkpoint.meta:  # from before windows: every seq up to the highest
            self.floors = dict(self.seqs)
        self.optimizer = self._fresh_optimizer()
        if (
            checkpoint.optimizer
            and checkpoint.meta.get("optimizer") == type(self.optimizer).__name__
        ):
            numbers = checkpoint.meta.get("optimizer_numbers", [])
            load_optimizer_state(self.optimizer, self.server, checkpoint.optimizer, numbers)

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        load_partial(self.server, weights)
        self._names = frozenset(weights)

    def _fresh_optimizer(self) -> torch.optim.Optimizer:
        # The schedule stands at this replica's version and its optimizer steps so far.
        version, steps = max(self.version, 1), self.steps
        return self._optimizer_factory(self.server.parameters(), version=version, steps=steps)

    def reset(self, store: WeightStore, job: str) -> str:
        """Back to the last checkpoint (or the version it started from); says which."""
        self._clear()
        checkpoint = store.load_checkpoint(job, self.shard)
        if checkpoint is not None:
            self.restore(checkpoint)
            return f"checkpoint ({checkpoint.applied} applied)"
        try:
            self.load_version(store, job, self.origin_version)
        except VersionNotFoundError:
            self.load_version(store, job, store.current_version(job))
        return f"version {self.version}"

    # --- bookkeeping --------------------------------------------------------------------------
    def begin_round(self, round_: int, cohort: Mapping[str, int]) -> None:
        if round_ != self.cohort_round:
            self.progress = {}
        self.cohort_round = round_
        self.cohort = dict(cohort)

    def end_round(self, round_: int) -> bool:
        """Mark `round_` handed in; False when it already was (a repeated RoundEnd)."""
        if round_ <= self.round:
            return False
        self.round = round_
        self.handed_in = True
        return True

    def start_counting(self) -> None:
        """The samples of the handed-in round are the aggregator's now: count the next one."""
        self.round_samples = 0
        self.cut_samples = {}
        self.handed_in = False

    def record(
        self,
        client: str,
        seq: int,
        step: int,
        steps: int,
        rows: int,
        cut: str = "",
        message_id: str = "",
    ) -> None:
        """One batch applied (`cut`: where its activations come from; "": the replica's), from
        message `message_id`."""
        # max(): a seq must never move back, or a later copy of a newer batch would pass.
        self.seqs[client] = max(seq, self.seqs.get(client, seq))
        recent = self.recent.setdefault(client, [])
        ids = self.recent_ids.setdefault(client, {})
        bisect.insort(recent, seq)
        if message_id:
            ids[seq] = message_id
        if len(recent) > RECENT_SEQS:
            oldest = recent.pop(0)
            ids.pop(oldest, None)
            self.floors[client] = max(oldest, self.floors.get(client, oldest))
        self.progress[client] = (step, steps)
        self.applied += 1
        count, seq_sum = self.audit.get(client, (0, 0))
        self.audit[client] = (count + 1, (seq_sum + seq) % AUDIT_MODULUS)
        self.round_samples += rows
        key = cut or self.cut
        self.cut_samples[key] = self.cut_samples.get(key, 0) + rows

    def applied_already(self, client: str, seq: int) -> bool:
        """Whether `client`'s batch `seq` is in this replica (then a copy, never applied again).

        Not merely "at or below the highest seq applied": a batch that a worker which lost the
        shard held unacknowledged can come back behind newer ones of its client (a quorum
        queue's take-over, docs/reliability.md, "Cluster chaos"), and is then still to apply.
        """
        if seq <= self.floors.get(client, seq - 1):
            return True
        recent = self.recent.get(client, [])
        at = bisect.bisect_left(recent, seq)
        return at < len(recent) and recent[at] == seq

    def applied_id(self, client: str, seq: int) -> str | None:
        """The message id recent seq `seq` of `client` was applied from (None: not kept)."""
        return self.recent_ids.get(client, {}).get(seq)

    def checkpoint(self, buffers: Mapping[str, torch.Tensor] | None = None) -> Checkpoint:
        """`buffers` replace the replica's own (a U-shaped step's forward, not applied yet,
        has moved BatchNorm's running statistics)."""
        state = {**self.server.state_dict(), **(buffers or {})}
        weights = {
            name: t.detach().to("cpu", copy=True)
            for name, t in state.items()
            if name in self._names
        }
        # The checks copy the maps: the replica goes on changing its own.
        meta: dict[str, Any] = {key: check(key, getattr(self, key)) for key, check in _META.items()}
        meta["handed_in"] = self.handed_in
        optimizer, numbers = optimizer_state(self.optimizer, self.server)
        meta["optimizer"] = type(self.optimizer).__name__
        meta["optimizer_numbers"] = numbers
        return Checkpoint(self.shard, self.applied, weights, meta, optimizer=optimizer)


def open_replica(
    store: WeightStore,
    job: str,
    make: Callable[[], Replica],
    logger: logging.Logger,
) -> Replica | None:
    """The shard's replica from its checkpoint, else from the current version; None while no
    version has been published yet."""
    replica = make()
    checkpoint = store.load_checkpoint(job, replica.shard)
    if checkpoint is not None:
        try:
            replica.restore(checkpoint)
            return replica
        except (ValueError, TypeError) as exc:  # StateDictError is a ValueError
            logger.error(
                "job %s shard %d: checkpoint unusable (%s); starting from the current version",
                job,
                replica.shard,
                exc,
            )
            replica = make()
    version = store.current_version(job)
    if version < 1:
        return None
    replica.load_version(store, job, version)
    replica.origin_version = version
    return replica


def _int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"checkpoint meta {key!r} must be an int, got {value!r}")
    return value


def _mapping(key: str, raw: object) -> Mapping[Any, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"checkpoint meta {key!r} must be a map, got {type(raw).__name__}")
    return raw


def _int_map(key: str, raw: object) -> dict[str, int]:
    return {str(k): int(v) for k, v in _mapping(key, raw).items()}


def _int_lists(key: str, raw: object) -> dict[str, list[int]]:
    return {str(k): sorted(int(v) for v in values) for k, values in _mapping(key, raw).items()}


def _id_maps(key: str, raw: object) -> dict[str, dict[int, str]]:
    return {
        str(k): {int(s): str(i) for s, i in _mapping(key, v).items()}
        for k, v in _mapping(key, raw).items()
    }


def _pairs(key: str, raw: object) -> dict[str, tuple[int, int]]:
    return {str(k): (int(v[0]), int(v[1])) for k, v in _mapping(key, raw).items()}


# The replica's fields its checkpoint's meta carries, each with its check.
_META: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(("version", "round", "round_samples", "steps", "cohort_round"), _int),
    **dict.fromkeys(("cut_samples", "seqs", "floors", "cohort"), _int_map),
    "recent": _int_lists,
    "recent_ids": _id_maps,
    **dict.fromkeys(("progress", "audit"), _pairs),
}
