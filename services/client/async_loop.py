"""A client in async mode (docs/async.md): train a local round, upload, take the newest
weights, again. There are no rounds to wait for.

The Welcome is the first base. After each WeightsUpdate the aggregator answers with a
WeightsAssignment of the newest version (or, for an update too stale to fold, an
`Error("too_stale")` and then the assignment); the client trains its next local round from
it at once. When a worker refuses its smashed data as too stale (`StaleWeights`), or the
round fails otherwise, the local round is dropped and the client asks for the newest weights
by joining again (a live member's Join is answered with a Welcome of the current version).
If no answer comes within `answer_timeout_s`, it asks the same way.

A client whose partition holds no training samples trains and uploads nothing (its updates
would report 0 samples, which the aggregator refuses as `no_samples`): it says so once and
stays a member, as in sync mode, where such members are left out of every cohort, until the
job's end dismisses it. Leaving early instead would read as a client that quit (and a
supervisor restarting it would only have it join and leave again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from broker.errors import EncodeError
from broker.messages import (
    ConfigValue,
    Error,
    Message,
    WeightsAssignment,
    Welcome,
    new_message_id,
)
from broker.topology import CONTROL_EXCHANGE, updates_routing_key
from services.algorithms.registry import build_strategy
from services.client.drops import drop_notice
from services.client.errors import RoundAborted, StaleWeights, Superseded
from services.client.link import ClientLink
from services.client.plan import config_int
from services.client.round import Membership, RoundRunner
from services.client.stats import ClientStats

ASYNC_MODE = "async"


def is_async(config: Mapping[str, ConfigValue]) -> bool:
    """Whether the service runs the job asynchronously (its Welcome's config says so)."""
    return config.get("mode") == ASYNC_MODE


@dataclass(frozen=True)
class Base:
    """Weights to train the next local round from."""

    version: int
    client_weights: Mapping[str, torch.Tensor]
    aux_weights: Mapping[str, torch.Tensor]
    config: Mapping[str, ConfigValue]
    next_round: int = 0

    @classmethod
    def of(cls, message: Welcome | WeightsAssignment, next_round: int) -> Base:
        return cls(
            message.version,
            message.client_weights,
            message.aux_weights,
            message.config,
            next_round,
        )


class AsyncLoop:
    def __init__(
        self,
        *,
        link: ClientLink,
        runner: RoundRunner,
        member: Membership,
        stats: ClientStats,
        samples: int,
        rejoin: Callable[[], object],
        note: Callable[[Message], None],
        answer_timeout_s: float,
        clock: Callable[[], float],
        logger: logging.Logger,
    ) -> None:
        self._link = link
        self._runner = runner
        self._member = member
        self._stats = stats
        self._samples = samples  # training samples of the member's partition
        self._rejoin = rejoin
        self._note = note
        self._answer_timeout_s = answer_timeout_s
        self._clock = clock
        self._log = logger

    def run(self, welcome: Welcome) -> None:
        """Train until the job is over (returns) or the client is stopped (raises)."""
        if self._samples == 0:
            self._idle()
            return
        base: Base | None = Base.of(welcome, 0)
        local = 0
        while base is not None:
            local = max(local, base.next_round)
            dropped = self._train(base, local)
            local += 1
            version = base.version
            base = self._next_base(local, ask=dropped is not None)
            if dropped is not None and base is not None:  # not merely the job's end
                self._dropped(local - 1, version, dropped)

    # --- one local round -----------------------------------------------------------------------
    def _train(self, base: Base, local: int) -> Exception | None:
        """One local round from `base`; None once its update is uploaded, else why not."""
        link, job, client = self._link, self._link.job, self._link.client
        link.version = base.version
        member = self._member = self._updated(self._member, base.config)
        assignment = WeightsAssignment(
            job=job,
            client=client,
            message_id=new_message_id(),
            version=base.version,
            round=local,
            participate=True,
            client_weights=base.client_weights,
            aux_weights=base.aux_weights,
            config=base.config,
        )
        try:
            update = self._runner.run(member, assignment)
            link.send(CONTROL_EXCHANGE, updates_routing_key(job), update)
        except StaleWeights as exc:
            self._stats.stale_rounds += 1
            return exc
        except (RoundAborted, EncodeError) as exc:
            self._stats.rounds_aborted += 1
            # Counted by the aggregator (a job whose every local round fails ends failed). No
            # real assignment was answered: the local one above never travelled.
            if not isinstance(exc, Superseded):
                notice = replace(drop_notice(job, client, assignment, exc), ref_message_id="")
                link.send(CONTROL_EXCHANGE, updates_routing_key(job), notice)
            return exc
        self._stats.rounds += 1
        self._log.info(
            "job %s client %s: local round %d uploaded (version %d): %s",
            job,
            client,
            local,
            base.version,
            {k: round(v, 4) for k, v in update.metrics.items()},
        )
        return None

    def _dropped(self, local: int, version: int, exc: Exception) -> None:
        # Too stale is async mode working as meant; anything else is worth a warning.
        level = logging.INFO if isinstance(exc, StaleWeights) else logging.WARNING
        self._log.log(
            level,
            "job %s client %s: local round %d (version %d) dropped: %s",
            self._link.job,
            self._link.client,
            local,
            version,
            exc,
        )

    def _updated(self, member: Membership, config: Mapping[str, ConfigValue]) -> Membership:
        plan = member.plan.updated(config)
        shard = config_int(config, "shard")
        same = (plan.algorithm, plan.params) == (member.plan.algorithm, member.plan.params)
        return replace(
            member,
            shard=member.shard if shard is None else shard,
            plan=plan,
            strategy=member.strategy if same else build_strategy(plan.algorithm, plan.params),
        )

    def _idle(self) -> None:
        """No training samples: wait, a member still (heartbeats go on), for the job's end."""
        self._log.warning(
            "job %s client %s: partition %d has no training samples; not training, staying a "
            "member until the job ends",
            self._link.job,
            self._link.client,
            self._member.partition,
        )
        while True:
            message = self._link.poll(self._answer_timeout_s, deferred=True)
            if isinstance(message, WeightsAssignment):
                if message.config.get("finished") is True:
                    self._dismissed(message.config)
                    return
            elif message is not None and not isinstance(message, Welcome):
                if isinstance(message, Error) and message.code == "unknown_member":
                    self._rejoin()  # expired (a long outage, say): stay a member
                self._note(message)

    def _dismissed(self, config: Mapping[str, ConfigValue]) -> None:
        status = self._stats.dismissed(config)
        if status != "finished":
            self._log.warning(
                "job %s client %s: the job ended: %s", self._link.job, self._link.client, status
            )

    # --- between local rounds ------------------------------------------------------------------
    def _next_base(self, local: int, *, ask: bool) -> Base | None:
        """The weights the service answers with; None when the job is over. `ask`: nothing
        was uploaded, so nothing will be answered unless we ask (by joining again) — unless
        what ended the round (the job's end, say) is already here."""
        deadline = self._clock() + (0.0 if ask else self._answer_timeout_s)
        while True:
            message = self._link.poll(max(0.0, deadline - self._clock()), deferred=True)
            if message is None:
                if self._clock() >= deadline:
                    if not ask:
                        self._log.warning(
                            "job %s client %s: no new weights after %.0f s; asking again",
                            self._link.job,
                            self._link.client,
                            self._answer_timeout_s,
                        )
                    ask = False
                    self._rejoin()
                    deadline = self._clock() + self._answer_timeout_s
                continue
            if isinstance(message, WeightsAssignment):
                if message.config.get("finished") is True:
                    status = self._stats.dismissed(message.config)
                    if status != "finished":
                        self._log.warning(
                            "job %s client %s: the job ended: %s",
                            self._link.job,
                            self._link.client,
                            status,
                        )
                    return None
                if message.participate:
                    return Base.of(message, message.round)
            elif isinstance(message, Welcome):
                # The answer to our own Join: shard and cut are the coordinator's record.
                self._member = replace(self._member, shard=message.shard, cut=message.cut)
                return Base.of(message, local)
            else:
                if isinstance(message, Error) and message.code == "unknown_member":
                    self._rejoin()
                self._note(message)
