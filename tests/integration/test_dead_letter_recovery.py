"""Issue 18, item 1: with `<job>.dead` deleted mid-run, garbage sent to every role's queue must
neither crash a role nor stay unacked; the job finishes and the dead-letter queue is back,
holding each bad message with its reason.

Every role (aggregator, coordinator, worker with its split-inference server, two clients) runs
on a thread of this process with its own connections to the real RabbitMQ and Redis, as in
`benchmarks/fuzz_services.py`, whose harness this borrows.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from benchmarks.fuzz_services import (
    CrashLog,
    FuzzConfig,
    RoleThread,
    drain_dead,
    job_settings,
)
from broker.topology import (
    CONTROL_EXCHANGE,
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    dead_queue_name,
    infer_routing_key,
    reply_routing_key,
    shard_routing_key,
    updates_routing_key,
)
from broker.transport import PublishOptions
from services.common.backends import Backends
from services.common.jobdata import load_job_dataset
from services.common.membership import client_members
from services.report.records import VersionRecord
from services.runtime.processes import clear_job
from services.runtime.roles import embedded_roles

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]

ROUNDS = 3
CLIENTS = ["client-0", "client-1"]
TIMEOUT_S = 180.0
# No valid message starts like this (the codec's magic is missing): every consumer must
# dead-letter it, with the reason that says so.
GARBAGE = b"\xc1\x00garbage"


def wait(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_garbage_after_the_dead_letter_queue_was_deleted_ends_nothing(
    amqp_url: str, redis_url: str
) -> None:
    job = f"dlq{uuid.uuid4().hex[:8]}"
    cfg = FuzzConfig(clients=len(CLIENTS), rounds=ROUNDS, steps=20)
    cfg = FuzzConfig(**{**cfg.__dict__, "amqp_url": amqp_url, "redis_url": redis_url})
    settings = job_settings(cfg, job)
    clear_job(settings, CLIENTS)
    backends = Backends(settings.broker, settings.store)
    records: list[VersionRecord] = []

    class Sink:
        def record(self, record: VersionRecord) -> None:
            records.append(record)

        def finish(self, status: str) -> None:
            pass

    crash_log = CrashLog()
    logging.getLogger().addHandler(crash_log)
    stop = threading.Event()
    specs = embedded_roles(settings, backends, Sink(), load_job_dataset(settings))
    roles = [RoleThread(spec, stop) for spec in specs]
    operator = backends.open_broker("dlq-operator")
    store = backends.open_store()
    targets = {
        "shard": (SMASHED_EXCHANGE, shard_routing_key(job, 0)),
        "infer": (SMASHED_EXCHANGE, infer_routing_key(job)),
        "control": (CONTROL_EXCHANGE, job),
        "updates": (CONTROL_EXCHANGE, updates_routing_key(job)),
        **{f"reply-{c}": (REPLIES_EXCHANGE, reply_routing_key(job, c)) for c in CLIENTS},
    }
    try:
        for role in roles:
            role.thread.start()
        wait(lambda: len(client_members(store, job)) == len(CLIENTS), "the clients to join")
        assert store.current_version(job) < ROUNDS, "the job outran the test"

        operator.delete_queue(dead_queue_name(job))  # an operator purging junk
        for target, (exchange, key) in targets.items():
            operator.publish(exchange, key, GARBAGE, PublishOptions(message_id=f"junk-{target}"))

        aggregator = next(r for r in roles if r.spec.kind == "aggregator")
        aggregator.thread.join(TIMEOUT_S)
        assert not aggregator.thread.is_alive(), "the job did not finish"
    finally:
        stop.set()
        for role in roles:
            role.thread.join(60.0)
        logging.getLogger().removeHandler(crash_log)

    try:
        errors = {r.spec.name: r.error for r in roles if r.error}
        assert errors == {} and crash_log.crashes == []
        assert len(records) == ROUNDS  # the job went on to its last version
        dead = drain_dead(operator, job)  # the queue is back: subscribing to it works
    finally:
        operator.close()
        store.close()
        clear_job(settings, CLIENTS)
    for target in targets:
        reasons = dead.get(f"junk-{target}")
        assert reasons is not None, f"junk sent to {target} is not in {dead_queue_name(job)}"
        assert all("bad magic" in r for r in reasons), (target, reasons)  # its reason
