"""Split inference at the workers: InferRequests answered with theta's logits, on a thread and
connection of their own, ahead of training (docs/algorithms.md, SplitGP, "Split inference";
the sender checks: docs/deployment.md, "Security"). `InferReply.version` says which version
answered: the one the request names, or the newest when that one is gone or 0 is named.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

import torch
from torch import nn

from broker.codec import decode
from broker.errors import (
    DecodeError,
    StaleDeliveryError,
    UnexpectedMessageError,
    VersionNotFoundError,
)
from broker.messages import Error, InferReply, InferRequest, new_message_id
from broker.store import NO_VERSION, VersionStore
from broker.topology import (
    dead_queue,
    infer_queue,
    infer_queue_name,
    infer_reply_routing_key,
)
from broker.transport import Broker, Delivery
from models.parts import ServerModel
from models.split import SplitNet
from models.state import load_partial
from services.common.backends import Backends
from services.config.root import Settings
from services.security.identity import client_id_problem, sender_check
from workers.replica import SERVER, ModelFactory, pick_device
from workers.replies import Replier, reject
from workers.shard_checks import shape_problem

# Unacked requests per server: a few, so that requests spread over the workers of a job.
INFER_PREFETCH = 4
# Versions of theta kept loaded (a client may still ask with the previous version's phi_k).
CACHED_VERSIONS = 2


@dataclass
class InferenceStats:
    requests: int = 0  # answered with logits
    rows: int = 0
    errors: int = 0  # answered with an Error
    undeliverable: int = 0  # the requester's reply queue was gone
    dead_lettered: Counter[str] = field(default_factory=Counter)


@dataclass(eq=False)
class ThetaCache:
    """theta of the last few versions, in eval mode on `device`."""

    store: VersionStore
    job: str
    template: SplitNet
    cut: str
    device: torch.device
    _models: OrderedDict[int, nn.Module] = field(default_factory=OrderedDict)

    def get(self, version: int) -> tuple[int, nn.Module] | None:
        """(the version used, its theta): `version` if retained, else the newest; None when
        nothing is published yet."""
        wanted = version
        if wanted == NO_VERSION or wanted not in self._models:
            current = self.store.current_version(self.job)
            if current == NO_VERSION:
                return None
            if wanted == NO_VERSION or wanted > current:
                wanted = current
        cached = self._models.get(wanted)
        if cached is not None:
            self._models.move_to_end(wanted)
            return wanted, cached
        try:
            weights = self.store.read_blob(self.job, wanted, SERVER)
        except VersionNotFoundError:  # expired by retention meanwhile: the newest answers
            wanted = self.store.current_version(self.job)
            weights = self.store.read_blob(self.job, wanted, SERVER)
        theta = ServerModel(copy.deepcopy(self.template), self.cut)
        load_partial(theta, weights)
        theta.to(self.device).eval()
        self._models[wanted] = theta
        while len(self._models) > CACHED_VERSIONS:
            self._models.popitem(last=False)
        return wanted, theta


@dataclass(eq=False)
class InferenceServer:
    """Answers a job's InferRequests; `run` it on a thread of its own (`start`)."""

    settings: Settings
    backends: Backends
    _: KW_ONLY
    worker_id: str
    model_factory: ModelFactory
    poll_s: float = 0.2
    logger: logging.Logger = field(
        default_factory=lambda: logging.getLogger("splitmq.worker.inference")
    )

    def __post_init__(self) -> None:
        self._job = self.settings.job.name
        self._cut_shape: tuple[int, ...] = ()
        self._senders = sender_check(self.settings)
        self.stats = InferenceStats()

    def start(self) -> Callable[[], None]:
        """`run` on a daemon thread; returns what stops and joins it."""
        stop = threading.Event()

        def run() -> None:
            try:
                self.run(stop)
            except Exception:
                # Training goes on without it; requesters get no answer and time out.
                self.logger.exception("split inference stopped after a failure")

        thread = threading.Thread(target=run, name=f"infer-{self.worker_id}", daemon=True)
        thread.start()

        def close() -> None:
            stop.set()
            thread.join(30.0)

        return close

    def run(self, stop: threading.Event) -> InferenceStats:
        template = self.model_factory()
        cut = self.settings.model.cut
        self._cut_shape = tuple(template.cut_shape(cut))
        name = f"splitmq-infer-{self.worker_id}"
        with (
            contextlib.closing(self.backends.open_store()) as store,
            contextlib.closing(self.backends.open_broker(name)) as broker,
        ):
            limits = self.settings.broker.queue_limits
            broker.declare([dead_queue(self._job), infer_queue(self._job, limits)])
            broker.subscribe(infer_queue_name(self._job), prefetch=INFER_PREFETCH)
            device = pick_device(self.settings.workers.device)
            thetas = ThetaCache(store, self._job, template, cut, device)
            replier = Replier(broker, stop, self.logger)
            while not stop.is_set():
                delivery = broker.get(self.poll_s)
                if delivery is not None:
                    self._handle(broker, replier, thetas, delivery)
        return self.stats

    # --- one request ------------------------------------------------------------------------------
    def _handle(
        self, broker: Broker, replier: Replier, thetas: ThetaCache, delivery: Delivery
    ) -> None:
        def refuse(code: str, detail: str) -> None:
            reject(broker, delivery, code, detail, self.stats.dead_lettered, self.logger)

        try:  # the type is checked before any tensor is decoded
            message = decode(delivery.body, expect=InferRequest)
        except UnexpectedMessageError as exc:
            refuse("wrong_type", f"{exc.type_name} does not belong on the infer queue")
            return
        except DecodeError as exc:
            refuse("decode", exc.reason)
            return
        # Nobody to answer: a client id that routes nowhere, or one the sender may not claim
        # (a service user, e.g. `splitmq infer`, asks for requesters of any name).
        bad_id = client_id_problem(message.client) if message.client else None
        service = delivery.user_id in self._senders.services
        forged = bad_id or (
            None if service else self._senders.client_problem(delivery, message.client)
        )
        if forged is not None:
            refuse("bad_client" if bad_id else "impostor", forged)
            return
        problem = self._problem(message)
        loaded = thetas.get(message.version) if problem is None else None
        if loaded is None:
            code, detail = problem or ("no_version", f"job {self._job} has no published version")
            if message.client:  # tell the requester, so it does not wait in vain
                error = Error(
                    job=message.job,
                    client=message.client,
                    message_id=new_message_id(),
                    version=message.version,
                    code=code,
                    reason=detail,
                    ref_message_id=message.message_id,
                )
                if replier.publish(error, infer_reply_routing_key(error.job, error.client)):
                    self.stats.errors += 1
            refuse(code, detail)
            return
        version, theta = loaded
        device = next(theta.parameters()).device
        with torch.no_grad():
            logits = theta(message.activations.to(device=device, dtype=torch.float32))
        reply = InferReply(
            job=message.job,
            client=message.client,
            message_id=new_message_id(),
            version=version,
            seq=message.seq,
            logits=logits.to(device="cpu", dtype=torch.float32).contiguous(),
        )
        # The requester's inference reply queue, not its training one (whose loop consumes it).
        if replier.publish(reply, infer_reply_routing_key(reply.job, reply.client)):
            self.stats.requests += 1
            self.stats.rows += int(message.activations.shape[0])
        elif not replier.stopping:
            # Nobody to answer (the requester never had a reply queue, or is gone): not lost
            # work but not served either; the dead-letter queue says whose it was.
            self.stats.undeliverable += 1
            refuse("undeliverable", f"the answer to {message.client!r} cannot be delivered")
            return
        # A lost connection returns the request to the queue: answered twice, harmlessly.
        with contextlib.suppress(StaleDeliveryError):
            broker.ack(delivery)

    def _problem(self, message: InferRequest) -> tuple[str, str] | None:
        if message.job != self._job:
            return "wrong_job", f"job {message.job!r} on the infer queue of job {self._job!r}"
        if not message.client:
            return "bad_client", "InferRequest without a client id to answer"
        wrong_shape = shape_problem(message.activations, self._cut_shape)
        return None if wrong_shape is None else ("bad_shape", wrong_shape)
