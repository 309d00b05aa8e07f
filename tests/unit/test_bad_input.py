"""Bad input at every consumer: the table of (consumer, bad input) → behaviour, enforced.

Each consumer of a queue the services read (a worker's shard queue, the infer queue, the
coordinator's control queue, the aggregator's updates queue, a client's reply queue, an events
subscriber's queue) gets every row of its part of `TABLE`, each published with its own message
id, followed by valid traffic. The test then checks, on the in-memory broker (same semantics
as RabbitMQ, see the contract suite):

- every row marked "dead-lettered" sits in `<job>.dead` exactly once, with an
  `x-splitmq-reason` that says what the row says;
- the consumer counted it, raised nothing, and still served the valid message after it
  (nothing valid is dropped);
- the rows marked otherwise (a replayed `seq`, a duplicate update) are not dead-lettered and
  not applied twice.

docs/reliability.md quotes this table.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.fuzz_mutations import (
    Context,
    assemble,
    length_lie,
    poisoned,
    refused,
    split,
    tensors,
)
from broker.codec import MAGIC, decode, encode
from broker.memory_broker import InMemoryBroker
from broker.messages import (
    Error,
    Event,
    GradientReply,
    Heartbeat,
    InferReply,
    InferRequest,
    Join,
    Leave,
    Message,
    RoundDropped,
    RoundEnd,
    RoundStart,
    ServerOutput,
    SmashedBatch,
    TailGradient,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)
from broker.topology import (
    CONTROL_EXCHANGE,
    EVENTS_EXCHANGE,
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    client_infer_reply_queue,
    dead_queue,
    dead_queue_name,
    events_queue,
    infer_reply_queue_name,
    infer_routing_key,
    job_queues,
    reply_queue,
    reply_queue_name,
    shard_routing_key,
    updates_queue,
    updates_queue_name,
    updates_routing_key,
)
from broker.transport import REASON_HEADER, Broker, PublishOptions
from models.split import SplitNet
from services.aggregator.gate import MemberBook, UpdateScreen, reference_of
from services.aggregator.inbox import UpdateInbox
from services.aggregator.round_gate import ClosedGate, OpenRound
from services.client.link import ClientLink
from services.client.plan import RoundPlan
from services.client.stats import ClientStats
from services.common.backends import Backends, Embedded
from services.common.handout import WeightsCache
from services.common.jobmodel import job_model
from services.common.membership import MemberInfo, member_id
from services.common.outbox import Outbox
from services.coordinator.coordinator import Coordinator
from services.dashboard.state import DashboardState
from services.dashboard.watch import JobWatcher
from services.security.identity import SenderCheck
from tests.unit.test_worker_support import CUT, make_settings, one_torch_thread, seed_version
from workers.inference import InferenceServer
from workers.worker import Worker

__all__ = ["one_torch_thread"]

LOG = logging.getLogger("test.bad_input")
DEAD = "dead-lettered"
WAIT_S = 10.0


@dataclass(frozen=True)
class Row:
    consumer: str  # shard | infer | control | updates | reply | events
    case: str  # what is wrong with the input
    reason: str  # what the x-splitmq-reason must say (a substring)
    behaviour: str = DEAD


# Rows for every consumer: the codec refuses these before anything else looks at them.
BYTES = (
    ("empty body", "truncated prefix"),
    ("random bytes", "bad magic"),
    ("truncated message", "truncated"),
    ("header length beyond the body or the limit", "header"),
    ("header claiming a 4-billion-entry map", "not valid msgpack"),
    ("unknown dtype in a tensor header", "dtype"),
    ("NaN in a float tensor", "NaN or infinite"),
)

TABLE: tuple[Row, ...] = (
    *(
        Row(c, case, reason)
        for c in ("shard", "infer", "control", "updates", "reply", "events")
        for case, reason in BYTES
    ),
    # worker, shard queue
    Row("shard", "Heartbeat (wrong type)", "wrong_type"),
    Row("shard", "batch of another job", "wrong_job"),
    Row("shard", "batch naming another shard", "wrong_shard"),
    Row("shard", "client id of 300 characters", "bad_client"),
    Row("shard", "client not admitted by the coordinator", "unknown_client"),
    Row("shard", "client outside the round's cohort", "not_in_cohort"),
    Row("shard", "activations of the wrong shape", "bad_shape"),
    Row("shard", "64 rows of the wrong shape (oversized)", "bad_shape"),
    Row("shard", "labels outside the classes", "bad_labels"),
    Row("shard", "a cut the model does not have", "bad_cut"),
    Row("shard", "RoundEnd with round >= version", "bad_marker"),
    Row("shard", "RoundStart of an unpublished version", "bad_marker"),
    Row("shard", "RoundStart with an empty participant", "bad_cohort"),
    Row("shard", "replayed seq (a copy of an applied batch)", "", "not applied; reply sent again"),
    Row("shard", "batch without labels (the job is not U-shaped)", "missing_labels"),
    Row("shard", "TailGradient (the job is not U-shaped)", "not_u_shaped"),
    # worker, shard queue of a U-shaped job (model.tail set)
    Row("u_shard", "batch carrying labels", "unexpected_labels"),
    Row("u_shard", "TailGradient of another job", "wrong_job"),
    Row("u_shard", "TailGradient from a client not admitted", "unknown_client"),
    Row("u_shard", "TailGradient of the wrong shape", "bad_shape"),
    Row("u_shard", "replayed TailGradient (a copy of an applied step's)", "", "reply sent again"),
    # worker, infer queue (SplitGP)
    Row("infer", "SmashedBatch (wrong type)", "wrong_type"),
    Row("infer", "request of another job", "wrong_job"),
    Row("infer", "requester id with dots", "bad_client"),
    Row("infer", "activations of the wrong shape", "bad_shape"),
    Row("infer", "requester without a reply queue", "undeliverable"),
    # coordinator, control queue
    Row("control", "WeightsUpdate (wrong type)", "does not belong"),
    Row("control", "Join of another job", "for job"),
    Row("control", "Heartbeat without a client id", "without a client id"),
    Row("control", "client id with non-ASCII letters", "is not 1-64 letters"),
    Row("control", "Join of a client without a reply queue (unknown)", "no reply queue"),
    Row("control", "Heartbeat of an unknown client", "unknown client"),
    Row("control", "Leave of an unknown client", "not a member"),
    Row("control", "Heartbeat claiming role worker", "only clients are members"),
    Row("control", "Join whose AMQP user_id is someone else", "does not match the AMQP user"),
    # aggregator, updates queue
    Row("updates", "Join (wrong type)", "does not belong"),
    Row("updates", "update of another job", "for job"),
    Row("updates", "client id with a space", "is not 1-64 letters"),
    Row("updates", "update whose AMQP user_id is someone else", "does not match the AMQP user"),
    Row("updates", "wrong tensor names", "unknown tensors"),
    Row("updates", "wrong tensor shapes", "shape"),
    Row("updates", "masks for tensors it does not have", "masks."),
    Row("updates", "based on another version", "based on version"),
    Row("updates", "for a round not open yet", "is not open"),
    Row("updates", "from a client outside the cohort", "is not in round"),
    Row("updates", "late, from a client without a reply queue", "unknown"),
    Row("updates", "a second update of one client (replay)", "", "ignored as a duplicate"),
    Row("updates", "RoundDropped from a client outside the cohort", "is not in round"),
    Row("updates", "RoundDropped for a round not open yet", "is not open"),
    Row("updates", "RoundDropped based on another version", "based on version"),
    Row("updates", "RoundDropped whose AMQP user_id is someone else", "does not match the AMQP"),
    Row("updates", "a second RoundDropped of one client (replay)", "", "ignored as a duplicate"),
    # ... and, once round 0 has closed, late traffic is still screened before it is late
    Row("updates", "RoundDropped from a non-member for a closed round", "not a member"),
    Row("updates", "update from a non-member for a closed round", "not a member"),
    Row("updates", "update with unknown tensors for a closed round", "unknown tensors"),
    Row("updates", "late update naming another version than its round's", "based on version"),
    Row("updates", "late RoundDropped naming another version than its round's", "based on version"),
    # client, reply queue
    Row("reply", "SmashedBatch (wrong type)", "does not belong"),
    Row("reply", "Error of another job", "for job"),
    Row("reply", "Error for another client", "for client"),
    Row("reply", "Welcome with tensors the model does not have", "unknown tensor"),
    Row("reply", "WeightsAssignment with a negative batch size", "batch_size"),
    Row("reply", "ServerOutput for a seq never sent", "never sent"),
    # events subscriber (dashboard)
    Row("events", "Join (not an event)", "is not an Event"),
)


def rows(consumer: str) -> list[Row]:
    return [row for row in TABLE if row.consumer == consumer]


def ids(consumer: str) -> dict[str, Row]:
    """Message id of each dead-lettered row of a consumer."""
    return {f"{consumer}-{i}": r for i, r in enumerate(rows(consumer)) if r.behaviour == DEAD}


def byte_body(case: str, seed: bytes, rng: random.Random) -> bytes:
    """The body of a row of `BYTES`, made from the valid `seed`."""
    if not tensors(seed):  # the tensor rows need a message that has some
        seed = encode(InferReply("j", "c", new_message_id(), 1, 1, torch.ones(2, 3)))
    header_end = 8 + int.from_bytes(seed[4:8], "little")
    makers: dict[str, Callable[[], bytes]] = {
        "empty body": lambda: b"",
        "random bytes": lambda: b"\x00" + rng.randbytes(100),
        "truncated message": lambda: seed[: (8 + header_end) // 2],
        "header length beyond the body or the limit": lambda: length_lie(rng, seed),
        "header claiming a 4-billion-entry map": lambda: (
            MAGIC + (5).to_bytes(4, "little") + b"\xdf\xff\xff\xff\xff"
        ),
        "unknown dtype in a tensor header": lambda: with_dtype(seed, "complex64"),
        "NaN in a float tensor": lambda: poisoned(seed),
    }
    body = makers[case]()
    assert refused(body), case
    return body


def with_dtype(seed: bytes, dtype: str) -> bytes:
    parts = split(seed)
    node: Any = parts.header
    for key in tensors(seed)[0].path:
        node = node[key]
    node["dtype"] = dtype
    return assemble(parts)


def dead_letters(broker: Broker, job: str) -> dict[str, list[str]]:
    """message id → reasons of everything in `<job>.dead`."""
    broker.subscribe(dead_queue_name(job), prefetch=1000)
    found: dict[str, list[str]] = {}
    while (delivery := broker.get(0.2)) is not None:
        broker.ack(delivery)
        found.setdefault(delivery.message_id or "", []).append(
            str(delivery.headers.get(REASON_HEADER, ""))
        )
    return found


def client_link(
    handle: Broker,
    job: str,
    stats: ClientStats,
    *,
    model: SplitNet | None = None,
    plan: RoundPlan | None = None,
    seq_start: int = 0,
) -> ClientLink:
    """Client c0's link over `handle`, opened: its reply queue and dead-letter path. It judges
    assignments by `model` and `plan` where given, replies by the seqs from `seq_start`."""
    link = ClientLink(
        handle,
        job=job,
        client="c0",
        stats=stats,
        stop=threading.Event(),
        clock=time.monotonic,
        logger=LOG,
        heartbeat_s=60.0,
        route_wait_s=1.0,
        rng=random.Random(0),
        model=model,
        plan=plan,
        seq_start=seq_start,
        reply=reply_queue(job, "c0"),
    )
    link.open()
    return link


def assert_dead_lettered(found: dict[str, list[str]], expected: dict[str, Row]) -> None:
    for mid, row in expected.items():
        reasons = found.get(mid, [])
        assert len(reasons) == 1, f"{row.consumer} / {row.case}: dead-lettered {reasons}"
        assert row.reason in reasons[0], f"{row.case}: reason {reasons[0]!r}"


def context(settings: Any, model: Any, job: str, members: Sequence[str]) -> Context:
    state = {n: t for n, t in model.state_dict().items() if n.startswith("blocks.0")}
    return Context(job, tuple(model.cut_shape(CUT)), model.num_classes, state, tuple(members))


def publish(
    broker: Broker, exchange: str, key: str, body: bytes, mid: str, user_id: str | None = None
) -> None:
    broker.publish(exchange, key, body, PublishOptions(mid, user_id=user_id))


# --- worker: shard queue ------------------------------------------------------------------------


def shard_bodies(ctx: Context, version: int) -> dict[str, tuple[bytes, str | None]]:
    job, mid = ctx.job, new_message_id
    z, y = torch.randn(4, *ctx.cut_shape), torch.randint(0, ctx.num_classes, (4,))

    def batch(client: str = "c0", **kw: Any) -> bytes:
        fields: dict[str, Any] = dict(job=job, client=client, message_id=mid(), version=version)
        fields.update(seq=9, shard=0, round=0, step=0, activations=z, labels=y)
        fields.update(kw)
        return encode(SmashedBatch(**fields))

    wrong = torch.randn(4, *(d + 1 for d in ctx.cut_shape))
    return {
        "Heartbeat (wrong type)": (encode(Heartbeat(job, "c0", mid(), 1)), None),
        "batch of another job": (batch(job=job + "-x"), None),
        "batch naming another shard": (batch(shard=3), None),
        "client id of 300 characters": (batch("x" * 300), None),
        "client not admitted by the coordinator": (batch("ghost", round=7), None),
        "client outside the round's cohort": (batch("ghost"), None),
        "activations of the wrong shape": (batch(activations=wrong), None),
        "64 rows of the wrong shape (oversized)": (
            batch(activations=torch.randn(64, 1, 2), labels=torch.zeros(64, dtype=torch.long)),
            None,
        ),
        "labels outside the classes": (batch(labels=torch.full((4,), 99)), None),
        "batch without labels (the job is not U-shaped)": (batch(labels=None), None),
        "TailGradient (the job is not U-shaped)": (
            encode(TailGradient(job, "c0", mid(), version, 9, 0, 0, torch.randn(4, 50))),
            None,
        ),
        "a cut the model does not have": (batch(cut="block9"), None),
        "RoundEnd with round >= version": (encode(RoundEnd(job, "", mid(), 1, 1, 0)), None),
        "RoundStart of an unpublished version": (
            encode(RoundStart(job, "", mid(), 5, 0, 0, {"c0": 8})),
            None,
        ),
        "RoundStart with an empty participant": (
            encode(RoundStart(job, "", mid(), 1, 0, 0, {"": 8})),
            None,
        ),
    }


def test_worker_shard_queue(job: str) -> None:
    settings = make_settings(job)
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    ctx = context(settings, model, job, ["c0"])
    rng = random.Random(1)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([*job_queues(job, 1), reply_queue(job, "c0")])
    key = shard_routing_key(job, 0)
    start = encode(RoundStart(job, "", new_message_id(), 1, 0, 0, {"c0": 8}))
    publish(broker, SMASHED_EXCHANGE, key, start, "start")
    seed = encode(
        SmashedBatch(
            job,
            "c0",
            new_message_id(),
            1,
            1,
            0,
            0,
            0,
            torch.randn(4, *ctx.cut_shape),
            torch.zeros(4, dtype=torch.long),
        )
    )
    bodies = shard_bodies(ctx, 1)
    for mid, row in ids("shard").items():
        body = bodies[row.case][0] if row.case in bodies else byte_body(row.case, seed, rng)
        publish(broker, SMASHED_EXCHANGE, key, body, mid)
    # Valid traffic after all of it: a batch, its replay, the end of the round.
    valid = encode(
        SmashedBatch(
            job,
            "c0",
            new_message_id(),
            1,
            0,
            0,
            0,
            0,
            torch.randn(4, *ctx.cut_shape),
            torch.zeros(4, dtype=torch.long),
        )
    )
    publish(broker, SMASHED_EXCHANGE, key, valid, "valid")
    publish(broker, SMASHED_EXCHANGE, key, valid, "replay")
    publish(
        broker, SMASHED_EXCHANGE, key, encode(RoundEnd(job, "", new_message_id(), 1, 0, 0)), "end"
    )

    stats = Worker(
        settings, Backends(settings.broker, settings.store, embedded), worker_id="w1"
    ).run(threading.Event(), burst=True)

    expected = ids("shard")
    assert_dead_lettered(dead_letters(broker, job), expected)
    assert stats.dead_lettered_total == len(expected)
    assert (stats.batches_applied, stats.duplicates_skipped) == (1, 1)
    replies = drain(broker, reply_queue_name(job, "c0"))
    answers = [r for r in replies if isinstance(r, GradientReply)]
    assert [(r.seq, r.status) for r in answers] == [(0, "ok"), (0, "ok")]  # its reply, again
    assert answers[0].grad is not None and answers[1].grad is not None
    assert torch.equal(answers[0].grad, answers[1].grad)


def drain(broker: Broker, queue: str, timeout: float = 0.5) -> list[Message]:
    broker.subscribe(queue, prefetch=100)
    out: list[Message] = []
    while (delivery := broker.get(timeout)) is not None:
        broker.ack(delivery)
        out.append(decode(delivery.body))
    broker.unsubscribe(queue)
    return out


def test_worker_shard_queue_in_the_secured_mode(job: str) -> None:
    settings = make_settings(job, security={"per_client_users": True})
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([*job_queues(job, 1), reply_queue(job, "c0")])
    key = shard_routing_key(job, 0)
    z, y = torch.randn(4, *model.cut_shape(CUT)), torch.zeros(4, dtype=torch.long)

    def batch(seq: int) -> bytes:
        return encode(SmashedBatch(job, "c0", new_message_id(), 1, seq, 0, 0, 0, z, y))

    start = encode(RoundStart(job, "", new_message_id(), 1, 0, 0, {"c0": 8}))
    publish(broker, SMASHED_EXCHANGE, key, start, "forged-start", user_id="c0")
    publish(broker, SMASHED_EXCHANGE, key, start, "start", user_id="guest")
    publish(broker, SMASHED_EXCHANGE, key, batch(0), "anonymous")
    publish(broker, SMASHED_EXCHANGE, key, batch(1), "impostor", user_id="mallory")
    publish(broker, SMASHED_EXCHANGE, key, batch(2), "valid", user_id=f"{job}.c0")
    end = encode(RoundEnd(job, "", new_message_id(), 1, 0, 0))
    publish(broker, SMASHED_EXCHANGE, key, end, "end", user_id="guest")

    stats = Worker(
        settings, Backends(settings.broker, settings.store, embedded), worker_id="w1"
    ).run(threading.Event(), burst=True)

    found = dead_letters(broker, job)
    assert set(found) == {"forged-start", "anonymous", "impostor"}
    assert "only service users ['guest']" in found["forged-start"][0]
    assert "no AMQP user_id" in found["anonymous"][0]
    assert "'mallory'" in found["impostor"][0]
    assert stats.batches_applied == 1 and stats.dead_lettered["impostor"] == 3


def test_worker_shard_queue_of_a_u_shaped_job(job: str) -> None:
    """Labels refused, tail gradients screened; a valid step's two halves applied once."""
    settings = make_settings(job, model={"tail": "classifier"})
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([*job_queues(job, 1), reply_queue(job, "c0")])
    key, mid = shard_routing_key(job, 0), new_message_id
    z, y = torch.randn(4, *model.cut_shape(CUT)), torch.zeros(4, dtype=torch.long)
    out_shape = (4, *model.server_output_shape())

    def batch(labels: torch.Tensor | None) -> bytes:
        return encode(SmashedBatch(job, "c0", mid(), 1, 0, 0, 0, 0, z, labels))

    def tail(grad: torch.Tensor, *, job_name: str = job, client: str = "c0") -> bytes:
        return encode(TailGradient(job_name, client, mid(), 1, 0, 0, 0, grad))

    grad = torch.randn(out_shape)
    before = {
        "batch carrying labels": batch(y),
        "TailGradient of another job": tail(grad, job_name=job + "-x"),
        "TailGradient from a client not admitted": tail(grad, client="ghost"),
    }
    start = encode(RoundStart(job, "", mid(), 1, 0, 0, {"c0": 8}))
    publish(broker, SMASHED_EXCHANGE, key, start, "start")
    expected = ids("u_shard")
    by_case = {row.case: message_id for message_id, row in expected.items()}
    for case, body in before.items():
        publish(broker, SMASHED_EXCHANGE, key, body, by_case[case])
    # The valid step's two halves, a tail gradient of the wrong shape while it is open, a copy.
    publish(broker, SMASHED_EXCHANGE, key, batch(None), "valid")
    wrong = tail(torch.randn(4, 7))
    publish(broker, SMASHED_EXCHANGE, key, wrong, by_case["TailGradient of the wrong shape"])
    publish(broker, SMASHED_EXCHANGE, key, tail(grad), "valid-tail")
    publish(broker, SMASHED_EXCHANGE, key, tail(grad), "replayed-tail")
    publish(broker, SMASHED_EXCHANGE, key, encode(RoundEnd(job, "", mid(), 1, 0, 0)), "end")

    stats = Worker(
        settings, Backends(settings.broker, settings.store, embedded), worker_id="w1"
    ).run(threading.Event(), burst=True)

    assert_dead_lettered(dead_letters(broker, job), expected)
    assert stats.dead_lettered_total == len(expected)
    assert (stats.batches_applied, stats.duplicates_skipped) == (1, 1)
    replies = drain(broker, reply_queue_name(job, "c0"))
    assert [type(r).__name__ for r in replies] == ["ServerOutput", "GradientReply", "GradientReply"]
    output, first, again = replies
    assert isinstance(output, ServerOutput) and tuple(output.activations.shape) == out_shape
    assert isinstance(first, GradientReply) and isinstance(again, GradientReply)
    assert (first.status, again.status) == ("ok", "ok")  # its reply, again
    assert first.grad is not None and again.grad is not None
    assert first.grad.shape == z.shape and torch.equal(first.grad, again.grad)


# --- worker: infer queue --------------------------------------------------------------------------


def test_worker_infer_queue(job: str) -> None:
    settings = make_settings(job, algorithm={"name": "splitgp", "lr": 0.05})
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    rng = random.Random(2)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([*job_queues(job, 1), client_infer_reply_queue(job, "asker")])
    key = infer_routing_key(job)
    z = torch.randn(3, *model.cut_shape(CUT))
    seed = encode(InferRequest(job, "asker", new_message_id(), 1, 1, z))
    bodies = {
        "SmashedBatch (wrong type)": encode(
            SmashedBatch(
                job, "asker", new_message_id(), 1, 1, 0, 0, 0, z, torch.zeros(3, dtype=torch.long)
            )
        ),
        "request of another job": encode(
            InferRequest(job + "x", "asker", new_message_id(), 1, 1, z)
        ),
        "requester id with dots": encode(InferRequest(job, "a.b.c", new_message_id(), 1, 1, z)),
        "activations of the wrong shape": encode(
            InferRequest(job, "asker", new_message_id(), 1, 1, torch.randn(3, 2))
        ),
        "requester without a reply queue": encode(
            InferRequest(job, "nobody", new_message_id(), 1, 1, z)
        ),
    }
    for mid, row in ids("infer").items():
        body = bodies.get(row.case) or byte_body(row.case, seed, rng)
        publish(broker, SMASHED_EXCHANGE, key, body, mid)
    publish(broker, SMASHED_EXCHANGE, key, seed, "valid")
    backends = Backends(settings.broker, settings.store, embedded)
    server = InferenceServer(settings, backends, worker_id="w1", model_factory=lambda: model)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,))
    thread.start()
    try:
        answers = wait_for(
            lambda: drain(broker, infer_reply_queue_name(job, "asker"), 0.2),
            lambda got: any(isinstance(m, InferReply) for m in got),
        )
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    expected = ids("infer")
    assert_dead_lettered(dead_letters(broker, job), expected)
    assert sum(server.stats.dead_lettered.values()) == len(expected)
    assert server.stats.requests == 1
    # Requests it could answer but refused get an Error, so their requester does not wait.
    assert {m.code for m in answers if isinstance(m, Error)} == {"bad_shape"}


def wait_for(
    probe: Callable[[], list[Message]], done: Callable[[list[Message]], bool]
) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got += probe()
        if done(got):
            return got
    raise AssertionError(f"timed out; got {got}")


# --- coordinator: control queue -------------------------------------------------------------------


def test_coordinator_control_queue(job: str) -> None:
    settings = make_settings(job, clients={"count": 1})
    embedded = Embedded()
    seed_version(embedded.store, settings)
    rng = random.Random(3)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([*job_queues(job, 1), reply_queue(job, "c0")])
    mallory = InMemoryBroker(embedded.hub, user="mallory")
    mid = new_message_id
    seed = encode(Join(job, "c0", mid(), 0, 10))
    bodies = {
        "WeightsUpdate (wrong type)": encode(WeightsUpdate(job, "c0", mid(), 1, 0, 1, {}, {})),
        "Join of another job": encode(Join(job + "x", "c0", mid(), 0, 10)),
        "Heartbeat without a client id": encode(Heartbeat(job, "", mid(), 0)),
        "client id with non-ASCII letters": encode(Join(job, "çlient", mid(), 0, 10)),
        "Join of a client without a reply queue (unknown)": encode(
            Join(job, "ghost", mid(), 0, 10)
        ),
        "Heartbeat of an unknown client": encode(Heartbeat(job, "ghost", mid(), 0)),
        "Leave of an unknown client": encode(Leave(job, "ghost", mid(), 0, "bye")),
        "Heartbeat claiming role worker": encode(Heartbeat(job, "c0", mid(), 0, role="worker")),
    }
    for message_id, row in ids("control").items():
        if row.case == "Join whose AMQP user_id is someone else":
            mallory.publish(
                CONTROL_EXCHANGE,
                job,
                seed,
                PublishOptions(message_id=message_id, user_id="mallory"),
            )
            continue
        body = bodies.get(row.case) or byte_body(row.case, seed, rng)
        publish(broker, CONTROL_EXCHANGE, job, body, message_id)
    publish(broker, CONTROL_EXCHANGE, job, seed, "valid")
    coordinator = Coordinator(
        settings, Backends(settings.broker, settings.store, embedded), poll_s=0.02
    )
    stop = threading.Event()
    thread = threading.Thread(target=coordinator.run, args=(stop,))
    thread.start()
    try:
        replies = wait_for(
            lambda: drain(broker, reply_queue_name(job, "c0"), 0.2),
            lambda got: any(isinstance(m, Welcome) for m in got),
        )
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    expected = ids("control")
    assert_dead_lettered(dead_letters(broker, job), expected)
    assert coordinator.stats.dead_lettered == len(expected)
    assert coordinator.stats.joined == 1 and any(isinstance(m, Welcome) for m in replies)


# --- aggregator: updates queue --------------------------------------------------------------------


def test_aggregator_updates_queue(job: str) -> None:
    settings = make_settings(job)
    embedded = Embedded()
    seed_version(embedded.store, settings)
    rng = random.Random(4)
    broker = InMemoryBroker(embedded.hub)
    broker.declare(
        [dead_queue(job), updates_queue(job), reply_queue(job, "c0"), reply_queue(job, "c1")]
    )
    broker.declare([reply_queue(job, "c7")])  # a stranger's queue: told nothing all the same
    weights, aux = WeightsCache(embedded.store, job, 1).global_weights()
    members = MemberBook(embedded.store, job)
    for i, client in enumerate(("c0", "c1", "c2", "c9")):
        info = MemberInfo(client, 0, CUT, 10, i).to_info()
        embedded.store.heartbeat(job, member_id(client), 60.0, info)
    member = MemberInfo("c0", 0, CUT, 10, 0)
    gate = OpenRound(
        round=0,
        version=1,
        # c0 uploads, c2 says it dropped the round.
        cohort={"c0": member, "c2": MemberInfo("c2", 0, CUT, 10, 2)},
        opened_at=0.0,
        deadline_s=60,
        quorum=1.0,
        client_ref=reference_of(weights),
        aux_ref=reference_of(aux),
        earlier=frozenset({"c9"}),
    )
    mid = new_message_id

    def update(client: str = "c0", **kw: Any) -> bytes:
        fields: dict[str, Any] = dict(
            job=job,
            client=client,
            message_id=mid(),
            version=1,
            round=0,
            samples=10,
            client_weights=weights,
            aux_weights={},
        )
        fields.update(kw)
        return encode(WeightsUpdate(**fields))

    def dropped(client: str = "c2", **kw: Any) -> bytes:
        fields: dict[str, Any] = dict(
            job=job, client=client, message_id=mid(), version=1, round=0, reason="non_finite"
        )
        fields.update(kw)
        return encode(RoundDropped(**fields))

    first = next(iter(weights))
    bodies = {
        "Join (wrong type)": encode(Join(job, "c0", mid(), 0, 1)),
        "update of another job": update(job=job + "x"),
        "client id with a space": update("c 0"),
        "wrong tensor names": update(client_weights={f"x{n}": t for n, t in weights.items()}),
        "wrong tensor shapes": update(client_weights={**weights, first: torch.zeros(2, 2)}),
        "masks for tensors it does not have": update(
            masks={"nope": torch.ones(2, dtype=torch.bool)}
        ),
        "based on another version": update(version=2),
        "for a round not open yet": update(round=1),
        "from a client outside the cohort": update("c1"),
        "late, from a client without a reply queue": update("c9"),
        "RoundDropped from a client outside the cohort": dropped("c1"),
        "RoundDropped for a round not open yet": dropped(round=1),
        "RoundDropped based on another version": dropped(version=2),
    }
    after_round_0 = {
        "RoundDropped from a non-member for a closed round": dropped("c7"),
        "update from a non-member for a closed round": update("c7"),
        "update with unknown tensors for a closed round": update(
            client_weights={**weights, "nope": torch.zeros(1)}
        ),
        # Round 0 trains version 1: junk in a member's name is not acked as late (issue 33).
        "late update naming another version than its round's": update(version=999),
        "late RoundDropped naming another version than its round's": dropped(version=999),
    }
    impostors = {
        "update whose AMQP user_id is someone else": update(),
        "RoundDropped whose AMQP user_id is someone else": dropped(),
    }
    mallory = InMemoryBroker(embedded.hub, user="mallory")
    key = updates_routing_key(job)
    for message_id, row in ids("updates").items():
        if row.case in after_round_0:
            continue
        if row.case in impostors:
            mallory.publish(
                CONTROL_EXCHANGE,
                key,
                impostors[row.case],
                PublishOptions(message_id=message_id, user_id="mallory"),
            )
            continue
        body = bodies.get(row.case) or byte_body(row.case, update(), rng)
        publish(broker, CONTROL_EXCHANGE, key, body, message_id)
    valid = update()
    publish(broker, CONTROL_EXCHANGE, key, valid, "valid")
    publish(broker, CONTROL_EXCHANGE, key, valid, "replay")
    drop = dropped()
    publish(broker, CONTROL_EXCHANGE, key, drop, "drop")
    publish(broker, CONTROL_EXCHANGE, key, drop, "drop-replay")

    handle = InMemoryBroker(embedded.hub)
    handle.declare([dead_queue(job), updates_queue(job)])
    handle.subscribe(updates_queue_name(job), prefetch=100)
    screen = UpdateScreen.of(embedded.store, job, 1, members, partial=False)
    inbox = UpdateInbox(
        handle, Outbox(handle, job, LOG), job, LOG, screen=screen, senders=SenderCheck()
    )
    inbox.drain(gate, 1)
    for message_id, row in ids("updates").items():
        if row.case in after_round_0:
            publish(broker, CONTROL_EXCHANGE, key, after_round_0[row.case], message_id)
    inbox.drain(ClosedGate(0), 2)

    expected = ids("updates")
    assert_dead_lettered(dead_letters(broker, job), expected)
    assert inbox.stats.dead_lettered == len(expected)
    assert (inbox.stats.accepted, inbox.stats.drops, inbox.stats.duplicates) == (1, 1, 2)
    assert set(gate.updates) == {"c0"} and gate.declined == {"c2": "non_finite"}
    assert not gate.waiting()  # everyone answered: the round need not wait for its deadline


# --- client: reply queue --------------------------------------------------------------------------


def test_client_reply_queue(job: str) -> None:
    settings = make_settings(job)
    embedded = Embedded()
    rng = random.Random(5)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([dead_queue(job)])
    handle = InMemoryBroker(embedded.hub)
    handle.declare([dead_queue(job)])
    stats = ClientStats()
    plan = RoundPlan.from_settings(settings)
    link = client_link(handle, job, stats, model=job_model(settings), plan=plan)
    mid = new_message_id
    z = torch.randn(2, 3)
    seed = encode(Error(job, "c0", mid(), 1, "x", "seed"))
    bodies = {
        "SmashedBatch (wrong type)": encode(
            SmashedBatch(job, "c0", mid(), 1, 1, 0, 0, 0, z, torch.zeros(2, dtype=torch.long))
        ),
        "Error of another job": encode(Error(job + "x", "c0", mid(), 1, "x", "y")),
        "Error for another client": encode(Error(job, "c1", mid(), 1, "x", "y")),
        "Welcome with tensors the model does not have": encode(
            Welcome(job, "c0", mid(), 1, 0, CUT, 0, {"nope": torch.zeros(1)}, {}, {})
        ),
        "WeightsAssignment with a negative batch size": encode(
            WeightsAssignment(job, "c0", mid(), 1, 0, True, {}, {}, {"batch_size": -4})
        ),
        "ServerOutput for a seq never sent": encode(ServerOutput(job, "c0", mid(), 1, 5, z)),
    }
    key = f"{job}.c0"
    for message_id, row in ids("reply").items():
        body = bodies.get(row.case) or byte_body(
            row.case,
            encode(GradientReply(job, "c0", mid(), 1, 1, "ok", 0.1, 1, 2, torch.randn(2, 3))),
            rng,
        )
        publish(broker, REPLIES_EXCHANGE, key, body, message_id)
    publish(broker, REPLIES_EXCHANGE, key, seed, "valid")

    message = link.poll(WAIT_S)

    assert isinstance(message, Error) and message.reason == "seed"
    expected = ids("reply")
    assert_dead_lettered(dead_letters(broker, job), expected)
    assert stats.dead_lettered == len(expected)


# --- events subscriber ----------------------------------------------------------------------------


def test_events_subscriber(job: str) -> None:
    settings = make_settings(job)
    embedded = Embedded()
    rng = random.Random(6)
    broker = InMemoryBroker(embedded.hub)
    broker.declare([dead_queue(job)])
    handle = InMemoryBroker(embedded.hub)
    spec = events_queue(job, "t")
    handle.declare([dead_queue(job), spec])
    handle.subscribe(spec.name, prefetch=100)
    state = DashboardState(job)
    watcher = JobWatcher(settings, Backends(settings.broker, settings.store, embedded), state=state)
    seed = encode(Event(job, "", new_message_id(), 2, "version_published", {"accuracy": 0.5}))
    for message_id, row in ids("events").items():
        body = (
            encode(Join(job, "c0", new_message_id(), 0, 1))
            if row.case.startswith("Join")
            else byte_body(row.case, seed, rng)
        )
        publish(broker, EVENTS_EXCHANGE, "", body, message_id)
    publish(broker, EVENTS_EXCHANGE, "", seed, "valid")
    while (delivery := handle.get(0.2)) is not None:
        watcher._on_delivery(handle, delivery)

    expected = ids("events")
    assert_dead_lettered(dead_letters(broker, job), expected)
    assert watcher.dead_lettered == len(expected)
    assert [e["kind"] for e in state.snapshot()["events"]] == ["version_published"]


def test_the_table_covers_every_consumer() -> None:
    consumers = {row.consumer for row in TABLE}
    assert consumers == {"shard", "u_shard", "infer", "control", "updates", "reply", "events"}
    for consumer in consumers:
        cases = [row.case for row in rows(consumer)]
        assert len(cases) == len(set(cases)), consumer


def test_the_docs_print_this_table() -> None:
    """docs/reliability.md shows every row (kept in step with the code)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    for row in TABLE:
        assert f"| {row.case} |" in doc, row.case
