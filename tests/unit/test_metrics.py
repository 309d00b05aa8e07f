"""Metrics: recorders, the metered broker, the busy meter, the HTTP endpoint, the settings."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.topology import SMASHED_EXCHANGE, dead_queue, shard_queue
from services.common.backends import Backends, Embedded
from services.config.loading import load_settings
from services.metrics.broker import BrokerMeter
from services.metrics.endpoint import metrics_route, serve
from services.metrics.prometheus import BusyMeter, PrometheusMeters
from services.metrics.recorder import NO_METRICS, reason_code


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    assert found is not None, f"{name}{labels} not exported"
    return found


def test_reason_codes_are_the_leading_identifier_or_one_bounded_fallback() -> None:
    assert reason_code("decode: truncated msgpack") == "decode"
    assert reason_code("non_finite: server step on seq 7") == "non_finite"
    assert reason_code("undecodable: bad type") == "undecodable"
    # Free text never becomes a label value: it would name clients and rounds.
    assert reason_code("client 'c-9' is not in round 3") == "rejected"
    assert reason_code("Join: x") == "rejected"
    assert reason_code("") == "rejected"


def test_busy_meter_is_one_minus_the_waiting_share_of_the_window() -> None:
    clock = FakeClock()
    meter = BusyMeter(window_s=10.0, clock=clock)
    clock.now += 4.0
    meter.waited(1.0)  # 1 s of 4 s waiting
    assert meter.fraction() == pytest.approx(0.75)
    # After a long idle stretch, only the last ~10 s count.
    for _ in range(30):
        clock.now += 1.0
        meter.waited(1.0)
    assert meter.fraction() == pytest.approx(0.0, abs=0.01)
    for _ in range(30):
        clock.now += 1.0
        meter.fraction()
    assert meter.fraction() == pytest.approx(1.0)


def test_a_wait_spanning_the_windows_start_counts_only_its_part_inside() -> None:
    # A role that waits in 0.2 s polls and works 1 % of the time: crediting each wait whole at
    # its end over-counted the window's waiting and clamped the fraction to 0.
    clock = FakeClock()
    meter = BusyMeter(window_s=10.0, clock=clock)
    for _ in range(400):  # 80 s: polls of 0.198 s waiting then 0.002 s of work
        clock.now += 0.198
        meter.waited(0.198)
        clock.now += 0.002
    assert meter.fraction() == pytest.approx(0.01, abs=0.002)
    # A wait in progress counts as busy until it ends; once credited, the window is all idle
    # from it.
    clock.now += 0.15
    meter.waited(0.15)
    assert 0.0 < meter.fraction() < 0.02


def test_role_recorders_export_labelled_families() -> None:
    meters = PrometheusMeters("jobx")
    worker = meters.role("worker", "w-1")
    worker.samples(32)
    worker.samples(16)
    worker.step(0.02)
    worker.staleness(0)
    worker.staleness(2)
    worker.staleness(-1)  # a batch from a newer version is not stale
    worker.dead_lettered("decode")
    worker.bytes_in(1000)
    worker.bytes_out(400)
    worker.waited(0.5)
    worker.queue_depth(3, 17)
    worker.version(5)
    worker.members("worker", 2)
    reg = meters.registry
    labels = {"splitmq_job": "jobx", "role": "worker", "member": "w-1"}
    assert value(reg, "splitmq_samples_total", **labels) == 48
    assert value(reg, "splitmq_step_latency_seconds_count", **labels) == 1
    assert value(reg, "splitmq_staleness_versions_count", **labels) == 3
    assert value(reg, "splitmq_staleness_versions_bucket", **labels, le="0.0") == 2
    assert value(reg, "splitmq_dead_lettered_total", **labels, reason="decode") == 1
    assert value(reg, "splitmq_bytes_in_total", **labels) == 1000
    assert value(reg, "splitmq_bytes_out_total", **labels) == 400
    assert value(reg, "splitmq_wait_seconds_total", **labels) == 0.5
    assert 0.0 <= value(reg, "splitmq_busy_fraction", **labels) <= 1.0
    assert value(reg, "splitmq_queue_depth", splitmq_job="jobx", shard="3") == 17
    assert value(reg, "splitmq_version", splitmq_job="jobx") == 5
    assert value(reg, "splitmq_members", splitmq_job="jobx", kind="worker") == 2
    # The same role is one recorder; the heartbeat info carries its samples and URL.
    assert meters.role("worker", "w-1") is worker
    meters.url = "http://127.0.0.1:9410"
    assert worker.member_info() == {"samples": "48", "metrics": "http://127.0.0.1:9410"}


def test_job_gauges_set_only_job_wide_values() -> None:
    meters = PrometheusMeters("jobx")
    gauges = meters.job_gauges()
    gauges.version(3)
    gauges.samples(10)  # not a role: ignored
    assert value(meters.registry, "splitmq_version", splitmq_job="jobx") == 3
    assert meters.registry.get_sample_value("splitmq_samples_total", {"role": "run"}) is None


def test_metered_broker_counts_bytes_waits_and_dead_letters_by_reason() -> None:
    hub = InMemoryHub()
    meters = PrometheusMeters("j")
    metrics = meters.role("worker", "w")
    broker = InMemoryBroker(hub, meter=BrokerMeter(metrics))
    broker.declare([dead_queue("j"), shard_queue("j", 0)])
    broker.publish(SMASHED_EXCHANGE, "j.0", b"x" * 100)
    broker.publish(SMASHED_EXCHANGE, "j.0", b"y" * 10)
    broker.subscribe("j.smashed.0", prefetch=4)
    first = broker.get(1.0)
    second = broker.get(1.0)
    assert first is not None and second is not None
    broker.dead_letter(first, "decode: not msgpack")
    broker.nack(second, requeue=False)
    assert broker.get(0.05) is None
    reg = meters.registry
    labels = {"splitmq_job": "j", "role": "worker", "member": "w"}
    assert value(reg, "splitmq_bytes_out_total", **labels) == 110
    assert value(reg, "splitmq_bytes_in_total", **labels) == 110
    assert value(reg, "splitmq_dead_lettered_total", **labels, reason="decode") == 1
    assert value(reg, "splitmq_dead_lettered_total", **labels, reason="nack") == 1
    assert value(reg, "splitmq_wait_seconds_total", **labels) >= 0.04
    assert broker.queue_depth("j.dead") == 2


def test_backends_meter_the_brokers_of_a_role_only_when_metrics_are_on() -> None:
    settings = load_settings(None, {})
    plain = Backends(settings.broker, settings.store, Embedded())
    unmetered = plain.for_role("worker", "w").open_broker()
    assert isinstance(unmetered, InMemoryBroker) and unmetered.meter is None
    assert plain.metrics is NO_METRICS
    metered = Backends(
        settings.broker, settings.store, Embedded(), meters=PrometheusMeters("j")
    ).for_role("worker", "w")
    assert metered.metrics.enabled
    broker = metered.open_broker()
    assert isinstance(broker, InMemoryBroker) and isinstance(broker.meter, BrokerMeter)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_endpoint_serves_metrics_and_takes_the_next_free_port() -> None:
    meters = PrometheusMeters("j")
    meters.role("aggregator").samples(7)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    try:
        endpoint = serve(
            {"/metrics": metrics_route(meters.registry)},
            host="127.0.0.1",
            first_port=taken,
            span=20,
        )
        assert endpoint is not None
        try:
            port = int(endpoint.url.rsplit(":", 1)[1])
            assert taken < port < taken + 20
            status, text = _get(endpoint.url + "/metrics")
            assert status == 200
            assert 'splitmq_samples_total{member="aggregator"' in text
            assert _get(endpoint.url + "/nothing")[0] == 404
        finally:
            endpoint.close()
    finally:
        busy.close()


def test_endpoint_gives_up_quietly_when_every_port_is_taken() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        assert serve({}, host="127.0.0.1", first_port=busy.getsockname()[1], span=1) is None
    finally:
        busy.close()


def test_metrics_section_ports_per_kind_and_environment_override() -> None:
    settings = load_settings(None, {})
    assert settings.metrics.enabled
    assert settings.metrics.first_port("coordinator") == 9400
    assert settings.metrics.first_port("aggregator") == 9401
    assert settings.metrics.first_port("worker") == 9410
    env = {"SPLITMQ_METRICS__PORT": "0", "SPLITMQ_METRICS__HOST": "0.0.0.0"}
    settings = load_settings(None, env)
    assert settings.metrics.first_port("worker") == 0
    assert settings.metrics.host == "0.0.0.0"
