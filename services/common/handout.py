"""What a client receives with a Welcome or a WeightsAssignment: its weights and its config.

Clients never read the store (design §3), so the coordinator and the aggregator copy the
client-side blobs of a version into the message: the client's personal blob when the
algorithm keeps one (`client/<id>`, `aux/<id>`), else the global one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from broker.messages import ConfigValue, WeightsAssignment, new_message_id
from broker.store import AUX_PART, CLIENT_PART, GLOBAL_OWNER, BlobRef, Manifest, VersionStore
from services.algorithms.training import LOSS_KEY, OPTIMIZER_KEY, SCHEDULE_KEY
from services.config.root import Settings

Tensors = dict[str, torch.Tensor]


def client_config(settings: Settings, partition: int) -> dict[str, ConfigValue]:
    """The algorithm parameters a client trains with (all roles read the same job file, but a
    client may run from a different one: the service's values win)."""
    algo = settings.algorithm
    # The defences travel as the algorithm's `privacy.` parameters: the strategy applies them.
    own = {**algo.params(), **settings.privacy.entries(settings.job.seed)}
    params = {f"params.{key}": value for key, value in own.items()}
    return {
        **params,
        "algorithm": algo.name,
        "batch_size": algo.batch_size,
        "lr": algo.lr,
        "momentum": algo.momentum,
        "server_lr": algo.effective_server_lr,
        "local_epochs": algo.local_epochs,
        "max_steps_per_round": algo.max_steps_per_round,
        "smashed_dtype": algo.smashed_dtype,
        # The recipe as JSON tables (services/algorithms/training.py parses them back); always
        # sent, so a client's own file never decides it.
        OPTIMIZER_KEY: settings.optimizer.as_config(),
        SCHEDULE_KEY: settings.schedule.as_config(),
        LOSS_KEY: settings.loss.as_config(),
        "partition": partition,
        "shards": settings.shards,
        # Async mode: the Welcome is the first assignment, each upload answered with the next.
        **({"mode": "async"} if settings.asynchronous_mode else {}),
    }


def assignment(
    settings: Settings, weights: WeightsCache, client: str, partition: int, round_index: int
) -> WeightsAssignment:
    """Weights of `weights.version` and the config for `client`'s next (local) round."""
    return WeightsAssignment(
        settings.job.name,
        client,
        new_message_id(),
        weights.version,
        round_index,
        True,
        *weights.for_client(client),  # client weights, aux weights
        client_config(settings, partition),
    )


# Longest job status a dismissal carries (a failure's reasons are short; this bounds them).
_STATUS_CHARS = 500


def dismissal(settings: Settings, client: str, version: int, status: str) -> WeightsAssignment:
    """The job is over: `participate=False, finished`, with the job's `status` ("finished", or
    "failed: <reason>"). The aggregator sends it to its members at the end, the coordinator to
    a client that joins later."""
    job, rounds = settings.job.name, settings.job.rounds
    config: dict[str, ConfigValue] = {"finished": True, "status": status[:_STATUS_CHARS]}
    return WeightsAssignment(job, client, new_message_id(), version, rounds, False, {}, {}, config)


@dataclass
class WeightsCache:
    """The client-side blobs of one version, read from the store once per blob."""

    store: VersionStore
    job: str
    version: int
    _manifest: Manifest | None = None
    _shared: dict[BlobRef, Tensors] = field(default_factory=dict)

    def global_weights(self) -> tuple[Tensors, Tensors]:
        """(client weights, aux weights) shared by the clients without personal ones."""
        return self.for_client(None)

    def for_client(self, client: str | None) -> tuple[Tensors, Tensors]:
        """(client weights, aux weights) for `client`; aux is empty when the version has none."""
        if self._manifest is None:
            self._manifest = self.store.manifest(self.job, self.version)
        out: list[Tensors] = []
        for part in (CLIENT_PART, AUX_PART):
            # `<part>/<client>` if the version holds it, else `<part>/global`, else none.
            refs = [BlobRef(part)] if client is None else [BlobRef(part, client), BlobRef(part)]
            ref = next((r for r in refs if r in self._manifest.entries), None)
            out.append({} if ref is None else self._read(ref))
        return out[0], out[1]

    def _read(self, ref: BlobRef) -> Tensors:
        blob = self._shared.get(ref)
        if blob is None:
            blob = self.store.read_blob(self.job, self.version, ref)
            # A personal blob goes to one client; only the global ones are worth keeping.
            if ref.owner == GLOBAL_OWNER:
                self._shared[ref] = blob
        return blob
