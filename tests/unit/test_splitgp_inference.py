"""Split inference over the in-memory broker: a worker's inference server answers
InferRequests with theta's logits, refuses bad ones, and answers while training traffic is
still queued on the shard."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from broker.codec import decode, encode
from broker.memory_broker import InMemoryBroker
from broker.messages import InferReply, InferRequest, new_message_id
from broker.topology import (
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    dead_queue_name,
    infer_reply_queue_name,
    infer_reply_routing_key,
    infer_routing_key,
    job_queues,
    reply_queue_name,
    shard_queue_name,
)
from broker.transport import REASON_HEADER, PublishOptions
from models.parts import ServerModel
from models.split import SplitNet
from services.algorithms.registry import build_strategy
from services.algorithms.splitgp import entropy
from services.client.inference import (
    BrokerTheta,
    InferenceError,
    LocalTheta,
    SplitPredictor,
    entropy_sweep,
)
from services.common.backends import Backends, Embedded
from services.security.identity import client_user
from services.security.provision import client_queues
from tests.unit.test_worker_support import (
    CUT,
    ScriptedClient,
    make_settings,
    random_batch,
    seed_version,
)
from workers.inference import InferenceServer
from workers.worker import Worker


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def setup(job: str) -> tuple[Any, Embedded, SplitNet]:
    settings = make_settings(job, algorithm={"name": "splitgp", "lr": 0.05})
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    ScriptedClient(InMemoryBroker(embedded.hub), job, settings.shards).declare(["c0"])
    return settings, embedded, model


def theta_of(model: SplitNet) -> ServerModel:
    return ServerModel(copy.deepcopy(model), CUT).eval()


@pytest.fixture
def served(job: str) -> Iterator[tuple[Any, Embedded, SplitNet, InferenceServer]]:
    settings, embedded, model = setup(job)
    backends = Backends(settings.broker, settings.store, embedded)
    server = InferenceServer(settings, backends, worker_id="w1", model_factory=lambda: model)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,))
    thread.start()
    yield settings, embedded, model, server
    stop.set()
    thread.join(10)


def test_requests_are_answered_with_theta_of_the_named_version(served: Any, job: str) -> None:
    _, embedded, model, server = served
    remote = BrokerTheta(InMemoryBroker(embedded.hub), job, version=1, chunk=5, timeout_s=10)
    z, _ = random_batch(model, torch.Generator().manual_seed(2), rows=12)
    logits = remote(z)  # three chunks of 5, 5, 2 rows, answered by seq
    with torch.no_grad():
        expected = theta_of(model)(z)
    assert_close(logits, expected)
    assert remote.last_version == 1
    assert server.stats.requests == 3 and server.stats.rows == 12


def test_a_bad_request_is_refused_to_its_requester_and_dead_lettered(served: Any, job: str) -> None:
    _, embedded, _, server = served
    broker = InMemoryBroker(embedded.hub)
    remote = BrokerTheta(broker, job, timeout_s=10)
    with pytest.raises(InferenceError, match="bad_shape"):
        remote(torch.zeros(2, 3, 4, 4))
    dead = InMemoryBroker(embedded.hub)
    dead.subscribe(dead_queue_name(job), prefetch=1)
    delivery = dead.get(5)
    assert delivery is not None
    assert str(delivery.headers[REASON_HEADER]).startswith("bad_shape: activations of shape")
    assert isinstance(decode(delivery.body), InferRequest)
    assert server.stats.dead_lettered["bad_shape"] == 1


def test_split_predictor_uses_the_head_below_the_threshold_and_theta_above(
    served: Any, job: str
) -> None:
    _, embedded, model, _ = served
    remote = BrokerTheta(InMemoryBroker(embedded.hub), job, timeout_s=10)
    x = torch.randn(30, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.eval()
        z = model.client_blocks(CUT)(x)
        head, full = model.head(CUT)(z), theta_of(model)(z)
    e = entropy(head)
    threshold = float(e.median())  # about half the rows each way; the median itself stays
    prediction = SplitPredictor(model, CUT, remote, threshold).predict(x)
    local = e <= threshold
    assert prediction.offloaded.tolist() == (~local).tolist()
    assert 0 < int(prediction.offloaded.sum()) < 30
    expected = torch.where(local, head.argmax(dim=1), full.argmax(dim=1))
    assert prediction.labels.tolist() == expected.tolist()

    # The sweep through the broker agrees with theta run locally.
    y = torch.randint(0, 10, (30,), generator=torch.Generator().manual_seed(5))
    thresholds = [0.0, threshold, 10.0]
    via_broker = entropy_sweep(SplitPredictor(model, CUT, remote, 0.0), x, y, thresholds)
    local_theta = LocalTheta(theta_of(model))
    via_local = entropy_sweep(SplitPredictor(model, CUT, local_theta, 0.0), x, y, thresholds)
    assert via_broker == via_local
    assert [p.offloaded for p in via_broker] == [1.0, float((~local).sum()) / 30, 0.0]


def test_inference_is_answered_while_training_traffic_is_queued(job: str) -> None:
    settings, embedded, model = setup(job)
    client = ScriptedClient(InMemoryBroker(embedded.hub), job, settings.shards)
    gen = torch.Generator().manual_seed(1)
    total = 400
    client.round_start(0, {"c0": total * 8})
    batch = random_batch(model, gen)
    for seq in range(total):
        client.batch("c0", seq, *batch, step=seq, steps=total)
    observer = InMemoryBroker(embedded.hub)
    shard = shard_queue_name(job, 0)
    stop = threading.Event()
    worker = Worker(settings, Backends(settings.broker, settings.store, embedded), worker_id="w1")
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    try:
        # Training has begun: gradients are coming back to c0.
        give_up = time.monotonic() + 30
        while observer.queue_depth(reply_queue_name(job, "c0")) == 0:
            assert time.monotonic() < give_up, "the worker never started training"
            time.sleep(0.01)
        remote = BrokerTheta(InMemoryBroker(embedded.hub), job, timeout_s=10)
        z, _ = random_batch(model, gen, rows=4)
        logits = remote(z)
        queued = observer.queue_depth(shard)
        applied = observer.queue_depth(reply_queue_name(job, "c0"))
    finally:
        stop.set()
        thread.join(30)
    with torch.no_grad():
        assert_close(logits, theta_of(model)(z))  # version 1's theta, not the replica's
    assert queued > 0, "the shard queue was drained before inference was answered"
    assert applied < total


def test_version_zero_or_unknown_is_answered_by_the_newest(served: Any, job: str) -> None:
    _, embedded, model, _ = served
    newer = copy.deepcopy(model)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.1)
    embedded.store.publish_version(job, 1, build_strategy("splitgp").initial_weights(newer, CUT))
    z, _ = random_batch(model, torch.Generator().manual_seed(6), rows=3)
    with torch.no_grad():
        old_logits, new_logits = theta_of(model)(z), theta_of(newer)(z)
    for asked, used, expected in ((1, 1, old_logits), (0, 2, new_logits), (7, 2, new_logits)):
        remote = BrokerTheta(InMemoryBroker(embedded.hub), job, version=asked, timeout_s=10)
        assert_close(remote(z), expected)
        assert remote.last_version == used


def test_a_job_without_service_side_is_a_clear_error() -> None:
    remote = BrokerTheta(InMemoryBroker(), "nojob", timeout_s=1)
    with pytest.raises(InferenceError, match="no infer queue"):
        remote(torch.zeros(1, 10, 12, 12))


def test_a_secured_client_is_answered_on_its_own_queue_and_may_not_ask_as_another(
    job: str,
) -> None:
    settings = make_settings(
        job, algorithm={"name": "splitgp", "lr": 0.05}, security={"per_client_users": True}
    )
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    services = InMemoryBroker(embedded.hub)
    # What `splitmq provision-clients` declares for c0 and c1.
    services.declare([*job_queues(job, 1), *client_queues(job, "c0"), *client_queues(job, "c1")])
    # An answer left over from an earlier handle of c0 (seqs from 1): not taken for this one's.
    stale = InferReply(job, "c0", new_message_id(), 1, 1, torch.zeros(1, 10))
    services.publish(
        REPLIES_EXCHANGE,
        infer_reply_routing_key(job, "c0"),
        encode(stale),
        PublishOptions(persistent=False),
    )
    user = client_user(job, "c0")  # c0's RabbitMQ user, as provisioned
    alice = InMemoryBroker(embedded.hub, user=user, stamp=user)
    z, _ = random_batch(model, torch.Generator().manual_seed(8), rows=3)
    claims_c1 = InferRequest(job, "c1", new_message_id(), 0, 1, z)
    alice.publish(
        SMASHED_EXCHANGE, infer_routing_key(job), encode(claims_c1), PublishOptions(message_id="c1")
    )
    anonymous = InferRequest(job, "c0", new_message_id(), 0, 1, z)
    InMemoryBroker(embedded.hub).publish(
        SMASHED_EXCHANGE,
        infer_routing_key(job),
        encode(anonymous),
        PublishOptions(message_id="anonymous"),
    )
    backends = Backends(settings.broker, settings.store, embedded)
    server = InferenceServer(settings, backends, worker_id="w1", model_factory=lambda: model)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,))
    thread.start()
    try:
        remote = BrokerTheta(alice, job, requester="c0", provisioned=True, timeout_s=10)
        logits = remote(z)  # handled after the two forged requests: one consumer, in order
    finally:
        stop.set()
        thread.join(10)
    with torch.no_grad():
        assert_close(logits, theta_of(model)(z))
    reasons = {}
    services.subscribe(dead_queue_name(job), prefetch=10)
    while (delivery := services.get(0.2)) is not None:
        reasons[delivery.message_id] = str(delivery.headers[REASON_HEADER])
    assert reasons == {
        "c1": f"impostor: client 'c1' does not match the AMQP user '{user}'",
        "anonymous": (
            "impostor: no AMQP user_id on a message of client 'c0': the secured mode "
            "(security.per_client_users) requires one"
        ),
    }
    assert server.stats.requests == 1
    # Nothing reached c1, nor c0's training reply queue.
    assert services.queue_depth(infer_reply_queue_name(job, "c1")) == 0
    assert services.queue_depth(reply_queue_name(job, "c0")) == 0
    with pytest.raises(ValueError, match="name the requester"):
        BrokerTheta(InMemoryBroker(embedded.hub), job, provisioned=True)
