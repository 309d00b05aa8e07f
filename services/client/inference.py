"""Split inference on a client (SplitGP): the client's head answers the rows it is sure of,
theta (`ServerLogits`: the workers over the broker, or in this process) the others
(docs/algorithms.md, SplitGP, "Split inference").
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from broker.codec import decode, encode
from broker.errors import (
    BackPressureError,
    DecodeError,
    SplitMQError,
    UnroutableError,
)
from broker.messages import Error, InferReply, InferRequest, Message, new_message_id
from broker.rejection import ack_safely, dead_letter_safely
from broker.topology import (
    SMASHED_EXCHANGE,
    infer_reply_queue,
    infer_routing_key,
)
from broker.transport import Broker, PublishOptions
from models.split import SplitNet, evaluating
from services.algorithms.splitgp import (
    SweepPoint,
    entropy,
    head_pass,
    row_results,
    stays_local,
    sweep,
)
from services.security.hidden import client_infer_queue

# Rows per InferRequest: a chunk of cnn5 cut activations is well under a megabyte.
DEFAULT_CHUNK = 256
# Random start of a handle's seqs: 2^48 apart on average, far from any earlier handle's range.
SEQ_BASE_BITS = 48
_SWEEP_CHUNK = 1024  # rows per head pass of entropy_sweep


class InferenceError(SplitMQError):
    """The server could not answer (refused the request, or no answer in time)."""


class ServerLogits(Protocol):
    def __call__(self, z: torch.Tensor) -> torch.Tensor: ...  # theta's logits, a row per row of z


class LocalTheta:
    """theta run in this process (no broker): for offline sweeps and tests."""

    def __init__(self, theta: nn.Module) -> None:
        self._theta = theta

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        with evaluating([self._theta]):
            logits: torch.Tensor = self._theta(z.to(torch.float32))
        return logits


class BrokerTheta:
    """theta's logits from the job's workers, over the broker (docs/algorithms.md, SplitGP).

    It owns `broker` (one thread, as every broker handle; `close` closes it). With
    `provisioned` it consumes the durable reply queue provisioned for client `requester`
    (docs/deployment.md, "Security"), under the name its password `secret` hides
    (services/security/hidden.py), else a private one. A call publishes its chunks all at
    once, so the workers answer them in parallel. `version`: the weights version `z` was
    computed with (0: the newest); `last_version`: the version that answered.
    """

    def __init__(
        self,
        broker: Broker,
        job: str,
        *,
        requester: str | None = None,
        provisioned: bool = False,
        secret: str = "",
        version: int = 0,
        timeout_s: float = 30.0,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        self._broker = broker
        self.job = job
        self.requester = requester or f"infer-{uuid.uuid4().hex[:12]}"
        self.version = version
        self.last_version = 0
        self._timeout_s = timeout_s
        self._chunk = chunk
        if provisioned and requester is None:
            raise ValueError("a provisioned reply queue belongs to a client: name the requester")
        # Seqs start at a random point: a provisioned queue outlives its consumers, so answers
        # to an earlier handle's requests (same requester, seqs from 1) may still be in it.
        self._seq = secrets.randbits(SEQ_BASE_BITS)
        spec = (
            client_infer_queue(job, self.requester, secret)
            if provisioned
            else infer_reply_queue(job, self.requester)
        )
        broker.declare([spec])
        broker.subscribe(spec.name, prefetch=64)

    def close(self) -> None:
        self._broker.close()

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if z.shape[0] == 0:
            raise ValueError("nothing to infer: z has no rows")
        pending: dict[int, int] = {}  # seq -> chunk index
        ids: dict[str, int] = {}  # message id -> seq, to match Error replies
        chunks = list(z.detach().split(self._chunk))
        for index, rows in enumerate(chunks):
            self._seq += 1
            request = InferRequest(
                job=self.job,
                client=self.requester,
                message_id=new_message_id(),
                version=self.version,
                seq=self._seq,
                activations=rows.to(device="cpu", dtype=torch.float32).contiguous(),
            )
            self._publish(encode(request), request.message_id)
            pending[self._seq] = index
            ids[request.message_id] = self._seq
        answers = self._gather(pending, ids, [int(c.shape[0]) for c in chunks])
        return torch.cat([answers[i] for i in range(len(chunks))])

    def _publish(self, body: bytes, message_id: str) -> None:
        """Publish one request, waiting out a full infer queue until the timeout."""
        deadline = time.monotonic() + self._timeout_s
        delay = 0.05
        while True:
            try:
                # Transient: a request is only worth answering while its requester waits.
                self._broker.publish(
                    SMASHED_EXCHANGE,
                    infer_routing_key(self.job),
                    body,
                    PublishOptions(message_id, persistent=False),
                )
                return
            except UnroutableError:
                raise InferenceError(
                    f"job {self.job} has no infer queue: its service side (workers, "
                    "coordinator, aggregator) has never run"
                ) from None
            except BackPressureError:
                if time.monotonic() + delay > deadline:
                    raise InferenceError(f"job {self.job}: the infer queue stays full") from None
                time.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _gather(
        self, pending: dict[int, int], ids: dict[str, int], rows: Sequence[int]
    ) -> dict[int, torch.Tensor]:
        answers: dict[int, torch.Tensor] = {}
        deadline = time.monotonic() + self._timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InferenceError(
                    f"job {self.job}: no answer to {len(pending)} InferRequest(s) after "
                    f"{self._timeout_s:.0f} s; is a worker of the job running?"
                )
            delivery = self._broker.get(min(left, 0.5))
            if delivery is None:
                continue
            try:
                message: Message | None = decode(delivery.body)
            except DecodeError as exc:
                dead_letter_safely(self._broker, delivery, f"undecodable: {exc.reason}")
                continue
            if not isinstance(message, InferReply | Error):
                kind = type(message).__name__
                dead_letter_safely(self._broker, delivery, f"{kind} is no answer to inference")
                continue
            # Our own queue: anything else answers an earlier call or handle, dropped.
            ack_safely(self._broker, delivery)
            if isinstance(message, Error) and message.ref_message_id in ids:
                raise InferenceError(f"inference refused: {message.code}: {message.reason}")
            if not isinstance(message, InferReply) or message.seq not in pending:
                continue
            index = pending.pop(message.seq)
            if tuple(message.logits.shape[:1]) != (rows[index],):
                raise InferenceError(
                    f"InferReply seq {message.seq}: {list(message.logits.shape)} logits for "
                    f"{rows[index]} rows"
                )
            answers[index] = message.logits.to(torch.float32)
            self.last_version = message.version
        return answers


@dataclass(frozen=True)
class SplitPrediction:
    labels: torch.Tensor
    offloaded: torch.Tensor  # bool per row: answered by the server
    entropy: torch.Tensor


class SplitPredictor:
    """A client's split inference with its `phi_k`, `h_k` (in `model`, at `cut`) and E_th."""

    def __init__(self, model: SplitNet, cut: str, server: ServerLogits, threshold: float) -> None:
        model.cut_index(cut)  # an unknown cut fails here, not at the first prediction
        self.model, self.cut = model, cut
        self.server = server
        self.threshold = threshold

    def predict(self, x: torch.Tensor) -> SplitPrediction:
        z, head_logits = head_pass(self.model, self.cut, x)
        e = entropy(head_logits)
        offloaded = ~stays_local(e, self.threshold)
        labels = head_logits.argmax(dim=1)
        if bool(offloaded.any()):
            answers = self.server(z[offloaded])  # one row per offloaded row, in order
            if answers.shape[0] != int(offloaded.sum()):
                raise ValueError(
                    f"{int(offloaded.sum())} rows offloaded but {answers.shape[0]} server answers"
                )
            labels[offloaded] = answers.argmax(dim=1).to(labels.device)
        return SplitPrediction(labels, offloaded, e)


def entropy_sweep(
    predictor: SplitPredictor,
    x: torch.Tensor,
    y: torch.Tensor,
    thresholds: Sequence[float],
) -> list[SweepPoint]:
    """Accuracy and the offloaded fraction of split inference at each threshold on (x, y);
    theta answers only the rows the smallest threshold offloads (a superset), once each."""
    if not thresholds:
        raise ValueError("no thresholds to sweep")
    results = row_results(
        predictor.model,
        predictor.cut,
        predictor.server,
        x,
        y,
        asked_above=min(thresholds),
        chunk=_SWEEP_CHUNK,
    )
    return sweep(results, thresholds)
