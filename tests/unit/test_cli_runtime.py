"""The runtime wiring under the CLI: supervising role threads, embedded settings, logging."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Sequence

import pytest

from services.common.backends import Backends
from services.common.logs import configured_logging
from services.common.supervise import JobFailedError, RoleSpec, Supervisor
from services.config.root import Settings
from services.data.loaders import Dataset
from services.report.records import ListSink, MetricsSink
from services.runtime.embedded import embedded_settings, run_embedded


class Serve:
    """Runs until stopped, like a worker or the coordinator."""

    def __init__(self) -> None:
        self.saw_stop = False

    def run(self, stop: threading.Event) -> None:
        stop.wait(30)
        self.saw_stop = stop.is_set()


class Finish:
    """Returns when `go` is set (or at once), like the aggregator or a client at the job's end."""

    def __init__(self, result: object = None, go: threading.Event | None = None) -> None:
        self.result = result
        self.go = go

    def run(self, stop: threading.Event) -> object:
        if self.go is not None:
            while not self.go.wait(0.01):
                if stop.is_set():
                    return "stopped"
        return self.result


class Crash:
    def __init__(self, after: threading.Event) -> None:
        self.after = after

    def run(self, stop: threading.Event) -> None:
        self.after.wait(5)
        raise RuntimeError("worker exploded")


class Deaf:
    """Ignores the stop event (a buggy role)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def run(self, stop: threading.Event) -> None:
        self.release.wait(10)


def test_job_finishes_when_aggregator_returns_and_others_are_stopped() -> None:
    go = threading.Event()
    worker, coordinator = Serve(), Serve()
    roles = [
        RoleSpec("aggregator", "aggregator", Finish(result=["v2"], go=go)),
        RoleSpec("coordinator", "coordinator", coordinator),
        RoleSpec("worker-0", "worker", worker),
        RoleSpec("client-0", "client", Finish(go=go)),
    ]
    stop = threading.Event()
    go.set()
    outcome = Supervisor(roles, stop, client_grace_s=5).run()
    assert outcome.status == "finished" and outcome.ok and outcome.exit_code == 0
    assert worker.saw_stop and coordinator.saw_stop
    assert outcome.stuck == ()


class FailJob:
    """An aggregator that ends the job as failed (after dismissing the clients: `dismissed`)."""

    def __init__(self, dismissed: threading.Event) -> None:
        self.dismissed = dismissed

    def run(self, stop: threading.Event) -> None:
        self.dismissed.set()
        raise JobFailedError("3 consecutive attempts at round 0 without one valid update")


def test_a_failed_job_ends_like_a_finished_one_with_its_reason() -> None:
    dismissed = threading.Event()
    worker, client = Serve(), Finish(result="left", go=dismissed)
    roles = [
        RoleSpec("aggregator", "aggregator", FailJob(dismissed)),
        RoleSpec("worker-0", "worker", worker),
        RoleSpec("client-0", "client", client),
    ]
    outcome = Supervisor(roles, threading.Event(), client_grace_s=5).run()
    assert outcome.status == "failed: 3 consecutive attempts at round 0 without one valid update"
    assert (outcome.ok, outcome.exit_code, outcome.failed_role) == (False, 1, "")
    assert outcome.traceback == "" and outcome.stuck == ()
    assert worker.saw_stop


def test_clients_that_do_not_leave_are_stopped_after_the_grace() -> None:
    lingering = Serve()
    roles = [
        RoleSpec("aggregator", "aggregator", Finish()),
        RoleSpec("client-0", "client", lingering),
    ]
    outcome = Supervisor(roles, threading.Event(), client_grace_s=0.05).run()
    assert outcome.status == "finished"
    assert lingering.saw_stop


def test_a_role_that_raises_stops_the_run_with_its_traceback() -> None:
    started = threading.Event()
    worker = Serve()
    roles = [
        RoleSpec("aggregator", "aggregator", Serve()),
        RoleSpec("worker-0", "worker", worker),
        RoleSpec("worker-1", "worker", Crash(after=started)),
    ]
    started.set()
    outcome = Supervisor(roles, threading.Event()).run()
    assert outcome.status.startswith("failed: worker-1: RuntimeError")
    assert outcome.failed_role == "worker-1"
    assert "worker exploded" in outcome.traceback and "Traceback" in outcome.traceback
    assert outcome.exit_code == 1
    assert worker.saw_stop


def test_external_stop_ends_the_run_as_stopped() -> None:
    stop = threading.Event()
    aggregator = Finish(go=threading.Event())
    roles = [RoleSpec("aggregator", "aggregator", aggregator)]
    timer = threading.Timer(0.05, stop.set)
    timer.start()
    outcome = Supervisor(roles, stop).run()
    timer.join()
    assert outcome.status == "stopped"
    assert outcome.exit_code == 130


def test_a_role_ignoring_stop_is_reported_not_waited_for_forever() -> None:
    release = threading.Event()
    roles = [
        RoleSpec("aggregator", "aggregator", Finish()),
        RoleSpec("worker-0", "worker", Deaf(release)),
    ]
    outcome = Supervisor(roles, threading.Event(), join_timeout_s=0.1).run()
    release.set()
    assert outcome.status == "finished"
    assert outcome.stuck == ("worker-0",)


def test_exactly_one_aggregator_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one aggregator"):
        Supervisor([RoleSpec("worker-0", "worker", Serve())], threading.Event())


def test_embedded_settings_force_memory_and_say_what_changed() -> None:
    settings = Settings.model_validate({"broker": {"kind": "rabbitmq"}, "store": {"kind": "redis"}})
    forced, changed = embedded_settings(settings)
    assert forced.broker.kind == "memory" and forced.store.kind == "memory"
    assert forced.job == settings.job
    assert changed == ["broker.kind 'rabbitmq' -> 'memory'", "store.kind 'redis' -> 'memory'"]
    same, none = embedded_settings(forced)
    assert same is forced and none == []


def test_run_embedded_wires_shared_backends_and_finishes_the_sink(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[Backends] = []

    def build(
        settings: Settings, backends: Backends, sink: MetricsSink, dataset: Dataset
    ) -> Sequence[RoleSpec]:
        seen.append(backends)
        assert backends.broker_settings.kind == "memory"
        assert dataset is marker
        return [RoleSpec("aggregator", "aggregator", Finish(result=[]))]

    marker: Dataset = object()  # type: ignore[assignment]
    sink = ListSink()
    settings = Settings.model_validate({"broker": {"kind": "rabbitmq"}})
    with caplog.at_level(logging.WARNING, logger="splitmq.runtime"):
        outcome = run_embedded(
            settings, sink=sink, stop=threading.Event(), dataset=marker, build_roles=build
        )
    assert outcome.ok
    assert sink.status == "finished"
    assert seen[0].embedded is not None
    assert "in-memory broker and store (broker.kind 'rabbitmq' -> 'memory')" in caplog.text


def test_json_logs_carry_context_fields() -> None:
    stream = io.StringIO()
    log = logging.getLogger("splitmq.test")
    with configured_logging("INFO", json_lines=True, stream=stream, context={"role": "worker"}):
        log.info("applied %d", 3, extra={"job": "j1", "shard": 0, "version": 7})
        log.debug("hidden")
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed", extra={"client": "c1"})
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["msg"] == "applied 3" and first["level"] == "INFO"
    assert first["logger"] == "splitmq.test"
    assert (first["role"], first["job"], first["shard"], first["version"]) == ("worker", "j1", 0, 7)
    assert second["client"] == "c1" and "ValueError: bad" in second["exc"]
    # The handler is gone afterwards: repeated CLI invocations in one process do not stack.
    log.warning("after")
    assert "after" not in stream.getvalue()


def test_human_logs_are_one_readable_line() -> None:
    stream = io.StringIO()
    with configured_logging("WARNING", stream=stream):
        logging.getLogger("splitmq.worker").warning("shard %d lost", 2)
        logging.getLogger("splitmq.worker").info("quiet")
    text = stream.getvalue()
    assert text.count("\n") == 1
    assert "WARNING splitmq.worker: shard 2 lost" in text


def test_pika_return_and_nack_warnings_are_dropped_but_other_pika_warnings_kept() -> None:
    stream = io.StringIO()
    pika_log = logging.getLogger("pika.adapters.blocking_connection")
    with configured_logging("INFO", stream=stream):
        pika_log.warning("Published message was returned: _delivery_confirmation=True; ...")
        pika_log.warning("Message was Nack'ed by broker: nack=%r; channel=%s; ", "<Nack>", 1)
        pika_log.warning("Connection lost")
        pika_log.info("chatter")
    text = stream.getvalue()
    assert "returned" not in text
    assert "Nack" not in text
    assert "Connection lost" in text
    assert "chatter" not in text
