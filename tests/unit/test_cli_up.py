"""`splitmq up`'s process handling, with stand-in children (no torch, no servers)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from broker.errors import BrokerError
from broker.memory_broker import InMemoryBroker
from broker.topology import client_infer_reply_queue, job_queues, reply_queue
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.runtime.processes import (
    ChildSpec,
    LocalProcesses,
    child_env,
    child_specs,
    clear_job,
)

# Stand-in for `python -m services.cli.main <role> CONFIG ...`: argv[3] is the role.
FAKE = """
import os, signal, sys, time
role = sys.argv[3]
behaviour = os.environ.get("FAKE_" + role.upper(), "serve")
if behaviour.startswith("once-"):  # that the first time it starts, then serve
    marker = os.environ["FAKE_MARKERS"] + "/" + role
    behaviour = "serve" if os.path.exists(marker) else behaviour[5:]
    open(marker, "a").close()
print(f"{role} up", flush=True)
if behaviour == "sigkill":
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
if behaviour == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: (print(f"{role} bye", flush=True), sys.exit(0)))
if behaviour.startswith("exit"):
    time.sleep(0.2)
    sys.exit(int(behaviour[4:]))
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def start(
    fake_python: str, tmp_path: Path, behaviours: dict[str, str], **kw: Any
) -> tuple[LocalProcesses, list[str]]:
    lines: list[str] = []
    specs = [
        ChildSpec("aggregator", "aggregator"),
        ChildSpec("worker-0", "worker"),
        ChildSpec("client-0", "client"),
    ]
    env = dict(os.environ)
    env.update({f"FAKE_{role.upper()}": b for role, b in behaviours.items()})
    env["FAKE_MARKERS"] = str(tmp_path)
    procs = LocalProcesses(
        tmp_path / "job.toml", specs, env, echo=lines.append, python=fake_python, **kw
    )
    procs.start()
    return procs, lines


def test_job_ends_when_aggregator_exits_and_the_rest_get_sigterm(
    fake_python: str, tmp_path: Path
) -> None:
    procs, lines = start(
        fake_python, tmp_path, {"aggregator": "exit0", "client": "exit0"}, client_grace_s=5
    )
    result = procs.wait(threading.Event(), timeout_s=30)
    assert result.status == "finished" and result.exit_code == 0
    assert result.exit_codes == {"aggregator": 0, "worker-0": 0, "client-0": 0}
    assert "worker-0   | worker up" in lines
    assert "worker-0   | worker bye" in lines  # stopped by SIGTERM, gracefully


def test_a_failing_child_stops_everything(fake_python: str, tmp_path: Path) -> None:
    procs, lines = start(fake_python, tmp_path, {"client": "exit3"})
    result = procs.wait(threading.Event(), timeout_s=30)
    assert result.status == "failed: client-0 exited with code 3"
    assert not any("restarting" in line for line in lines)  # only workers are restarted
    assert result.exit_code == 1
    assert result.exit_codes["aggregator"] == 0  # it got SIGTERM and stopped cleanly
    assert "aggregator | aggregator bye" in lines


def test_a_killed_worker_is_restarted_and_the_job_goes_on(fake_python: str, tmp_path: Path) -> None:
    procs, lines = start(fake_python, tmp_path, {"worker": "once-sigkill"})
    stop = threading.Event()
    threading.Timer(3.0, stop.set).start()  # time to die and come back, then Ctrl-C
    result = procs.wait(stop)
    assert result.status == "stopped", lines
    assert "up         | worker-0 exited with code -9; restarting it (1 of 3)" in lines
    assert procs.restarts == {"worker-0": 1}
    assert sum(line == "worker-0   | worker up" for line in lines) == 2
    assert result.exit_codes["worker-0"] == 0  # the restarted one, stopped by SIGTERM


def test_a_worker_that_keeps_dying_fails_the_job_after_three_restarts(
    fake_python: str, tmp_path: Path
) -> None:
    procs, lines = start(fake_python, tmp_path, {"worker": "exit3"})
    result = procs.wait(threading.Event(), timeout_s=30)
    assert result.status == "failed: worker-0 exited with code 3"
    restarts = [line for line in lines if "restarting it" in line]
    assert restarts == [
        f"up         | worker-0 exited with code 3; restarting it ({n} of 3)" for n in (1, 2, 3)
    ]
    assert result.exit_codes["aggregator"] == 0


def test_a_child_ignoring_sigterm_is_killed(fake_python: str, tmp_path: Path) -> None:
    procs, lines = start(
        fake_python,
        tmp_path,
        {"aggregator": "exit0", "worker": "deaf", "client": "exit0"},
        stop_grace_s=0.5,
    )
    result = procs.wait(threading.Event(), timeout_s=30)
    assert result.status == "finished"
    assert result.exit_codes["worker-0"] == -9
    assert any("worker-0 ignored SIGTERM; killing it" in line for line in lines)


def test_stop_and_timeout(fake_python: str, tmp_path: Path) -> None:
    procs, _ = start(fake_python, tmp_path, {})
    stop = threading.Event()
    stop.set()
    assert procs.wait(stop).status == "stopped"
    procs, _ = start(fake_python, tmp_path, {})
    result = procs.wait(threading.Event(), timeout_s=0.5)
    assert result.status == "timeout" and result.exit_code == 1


def test_children_are_told_the_counts_and_the_real_servers(tmp_path: Path) -> None:
    env = child_env({"PATH": "/bin", "SPLITMQ_BROKER": "memory"}, workers=2, clients=3)
    assert env["SPLITMQ_BROKER"] == "rabbitmq" and env["SPLITMQ_STORE"] == "redis"
    assert env["SPLITMQ_WORKERS__COUNT"] == "2" and env["SPLITMQ_CLIENTS__COUNT"] == "3"
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    specs = child_specs(2, 3, tmp_path / "run")
    assert [s.name for s in specs] == [
        "aggregator",
        "coordinator",
        "worker-0",
        "worker-1",
        "client-0",
        "client-1",
        "client-2",
    ]
    assert specs[0].args[:2] == ("--run-dir", str(tmp_path / "run"))
    assert specs[-1].args == ("--id", "client-2", "--partition", "2")


def test_a_fresh_start_deletes_the_job_queues_and_every_client_reply_queue(job: str) -> None:
    """`--fresh` (clear_job) also deletes the durable inference reply queues that
    `provision-clients` declares: a stale run's answers would otherwise wait there."""
    settings = Settings.model_validate({"job": {"name": job}, "clients": {"count": 2}})
    embedded = Embedded()
    broker = InMemoryBroker(embedded.hub)
    clients = ["client-0", "client-1"]
    specs = job_queues(job, settings.shards)
    specs += [q for c in clients for q in (reply_queue(job, c), client_infer_reply_queue(job, c))]
    other = reply_queue(f"{job}x", "client-0")  # another job's: left alone
    broker.declare([*specs, other])
    embedded.store.heartbeat(job, "client:client-0", 30.0)

    clear_job(settings, clients, Backends(settings.broker, settings.store, embedded))

    for spec in specs:
        with pytest.raises(BrokerError, match="NOT_FOUND"):
            broker.queue_depth(spec.name)
    assert broker.queue_depth(other.name) == 0
    assert embedded.store.live_members(job) == {}
