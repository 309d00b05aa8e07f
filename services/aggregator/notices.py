"""The round clock's messages to its peers: RoundStart / RoundEnd markers on the shard queues,
WeightsAssignments to the clients (architecture steps 3, 6 and 7)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from broker.errors import UnroutableError
from broker.messages import ConfigValue, RoundEnd, RoundStart, WeightsAssignment, new_message_id
from broker.store import JobStatus, WeightStore
from services.common.handout import WeightsCache, client_config, dismissal
from services.common.membership import MemberInfo, client_members
from services.common.outbox import Outbox
from services.config.root import Settings


def cohort_shards(cohort: Mapping[str, MemberInfo]) -> dict[int, dict[str, ConfigValue]]:
    """Shard → {client: samples} of the cohort members it serves."""
    by_shard: dict[int, dict[str, ConfigValue]] = {}
    for client, info in sorted(cohort.items()):
        by_shard.setdefault(info.shard, {})[client] = info.samples
    return dict(sorted(by_shard.items()))


def announce_round(
    outbox: Outbox,
    job: str,
    version: int,
    cohort: Mapping[str, MemberInfo],
    stop: threading.Event,
) -> bool:
    """RoundStart to every shard with cohort members, ahead of the round's batches; False if
    `stop` came first."""
    for shard, participants in cohort_shards(cohort).items():
        start = RoundStart(job, "", new_message_id(), version, version - 1, shard, participants)
        if not outbox.to_shard(shard, start, stop):
            return False
    return True


def end_round(
    outbox: Outbox, job: str, version: int, shards: list[int], stop: threading.Event
) -> bool:
    """RoundEnd behind the round's batches: each shard's worker hands in its replica."""
    for shard in shards:
        end = RoundEnd(job, "", new_message_id(), version, version - 1, shard)
        if not outbox.to_shard(shard, end, stop):
            return False
    return True


@dataclass
class Assigned:
    bytes_sent: int = 0
    unreachable: list[str] = field(default_factory=list)
    # Client → message id of its assignment, which its `RoundDropped` quotes.
    message_ids: dict[str, str] = field(default_factory=dict)


def assign_round(
    outbox: Outbox,
    settings: Settings,
    weights: WeightsCache,
    cohort: Mapping[str, MemberInfo],
    logger: logging.Logger,
) -> Assigned:
    """A WeightsAssignment with its weights and config to each cohort member."""
    job, version = settings.job.name, weights.version
    out = Assigned()
    for client, info in cohort.items():
        client_weights, aux_weights = weights.for_client(client)
        assignment = WeightsAssignment(
            job=job,
            client=client,
            message_id=new_message_id(),
            version=version,
            round=version - 1,
            participate=True,
            client_weights=client_weights,
            aux_weights=aux_weights,
            config=client_config(settings, info.partition),
        )
        try:
            out.bytes_sent += outbox.reply(client, assignment)
            out.message_ids[client] = assignment.message_id
        except UnroutableError:
            logger.warning("job %s: client %s has no reply queue; not waiting for it", job, client)
            out.unreachable.append(client)
    return out


def dismiss(
    outbox: Outbox,
    settings: Settings,
    version: int,
    clients: list[str],
    logger: logging.Logger,
    *,
    status: str = "finished",
) -> None:
    """The job is over: `participate=False, finished` to each client, with the job's `status`
    ("finished", or "failed: <reason>")."""
    for client in clients:
        try:
            outbox.reply(client, dismissal(settings, client, version, status))
        except UnroutableError:
            logger.info("job %s: finished client %s has no reply queue", settings.job.name, client)


def end_job(
    store: WeightStore,
    outbox: Outbox,
    settings: Settings,
    version: int,
    ended: JobStatus,
    logger: logging.Logger,
) -> None:
    """Record how the job ended, dismiss every live member with that status and announce it
    (architecture step 7), in sync and async mode alike.

    The record is written before the members are read: a client that joins after this read
    is dismissed by the coordinator, which reads the record after writing the member.
    """
    store.set_job_status(settings.job.name, ended)
    members = sorted(client_members(store, settings.job.name))
    dismiss(outbox, settings, version, members, logger, status=ended.text)
    outbox.event("job_finished", version, {"rounds": settings.job.rounds, "status": ended.text})
