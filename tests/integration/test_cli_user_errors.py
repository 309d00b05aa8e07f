"""A user's mistake is one line on stderr and a non-zero exit, never a traceback (issue 18, 6).

Each case runs the real `splitmq` console script in its own process, as a user would: a wrong
URL scheme, an unreachable RabbitMQ or Redis (ports nobody listens on), a wrong password
against the real RabbitMQ, a bad client id, an out-of-range --partition, an unknown model.
`--debug` brings the traceback back.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SPLITMQ = str(Path(sys.executable).with_name("splitmq"))

JOB_TOML = """
[broker]
kind = "rabbitmq"
reconnect_give_up_s = 1.0
[store]
kind = "redis"
retry_for_s = 1.0
[job]
name = "{job}"
rounds = 1
[model]
name = "{model}"
[data]
dataset = "fashion_mnist_sample"
[clients]
count = 2
min_to_start = 2
[metrics]
enabled = false
[report]
dir = "{runs}"
"""


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def config(tmp_path: Path, job: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB_TOML.format(job=job, model="cnn5", runs=tmp_path / "runs"))
    return path


def splitmq(
    *args: str, amqp_url: str, redis_url: str, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env |= {"SPLITMQ_AMQP_URL": amqp_url, "SPLITMQ_REDIS_URL": redis_url}
    return subprocess.run(
        [SPLITMQ, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def one_error_line(proc: subprocess.CompletedProcess[str], *, retry_lines: int = 0) -> str:
    """The failure's line: the process failed, no traceback, and stderr holds that one line
    (after at most `retry_lines` WARNING/ERROR lines saying it waits for a server)."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 1 + retry_lines, proc.stderr
    return lines[-1]


@pytest.mark.rabbitmq
def test_wrong_amqp_url_scheme_is_one_line(config: Path, redis_url: str) -> None:
    proc = splitmq(
        "coordinator", str(config), amqp_url="http://127.0.0.1:5672/", redis_url=redis_url
    )

    line = one_error_line(proc)
    assert "must start with amqp:// or amqps://, got http://" in line
    assert "could not start" in line


@pytest.mark.redis
def test_wrong_redis_url_scheme_is_one_line(config: Path, amqp_url: str) -> None:
    proc = splitmq("aggregator", str(config), amqp_url=amqp_url, redis_url="http://127.0.0.1:1/0")

    line = one_error_line(proc)
    assert "must start with redis:// or rediss://, got http://" in line


def test_unreachable_broker_is_one_line_after_one_waiting_line(config: Path) -> None:
    url = f"amqp://guest:secret@127.0.0.1:{closed_port()}/%2F"
    proc = splitmq("worker", str(config), amqp_url=url, redis_url="redis://127.0.0.1:1/0")

    line = one_error_line(proc, retry_lines=1)
    assert "RabbitMQ unreachable at amqp://guest@127.0.0.1:" in line
    assert "Connection refused" in line and "start RabbitMQ or fix broker.amqp_url" in line
    assert "secret" not in proc.stderr
    assert "pika" not in proc.stderr  # pika's own error records, six per attempt, are dropped


@pytest.mark.rabbitmq
def test_wrong_password_is_one_line_saying_so(config: Path, amqp_url: str) -> None:
    bad = amqp_url.replace("guest:guest@", "guest:not-the-password@", 1)
    assert bad != amqp_url, "test expects the default guest credentials in the URL"
    proc = splitmq("client", str(config), amqp_url=bad, redis_url="redis://127.0.0.1:1/0")

    line = one_error_line(proc)
    assert "refused user 'guest': wrong password" in line
    assert "fix the user and password" in line
    assert "not-the-password" not in proc.stderr


@pytest.mark.rabbitmq
@pytest.mark.redis
def test_doctor_advises_fixing_the_password_not_starting_rabbitmq(
    config: Path, amqp_url: str, redis_url: str
) -> None:
    bad = amqp_url.replace("guest:guest@", "guest:not-the-password@", 1)
    proc = splitmq("--config", str(config), "doctor", amqp_url=bad, redis_url=redis_url)

    assert proc.returncode == 1
    assert "wrong password for user 'guest'" in proc.stdout
    assert "fix the user and password" in proc.stdout
    assert "rabbitmq-server" not in proc.stdout
    assert "not-the-password" not in proc.stdout + proc.stderr


@pytest.mark.rabbitmq
def test_unreachable_redis_is_one_line_after_its_waiting_lines(config: Path, amqp_url: str) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    proc = splitmq("coordinator", str(config), amqp_url=amqp_url, redis_url=url)

    # The store's "waiting for Redis up to 1 s" and "giving up" lines, then the role's.
    line = one_error_line(proc, retry_lines=2)
    assert "coordinator of job" in line and "could not start: redis unreachable" in line
    assert "start Redis or fix store.redis_url" in line


@pytest.mark.rabbitmq
def test_bad_client_id_is_one_line(config: Path, amqp_url: str) -> None:
    proc = splitmq("client", str(config), "--id", "bad id!", amqp_url=amqp_url, redis_url="")

    line = one_error_line(proc)
    assert "client id 'bad id!': use 1-64 letters" in line


@pytest.mark.rabbitmq
def test_out_of_range_partition_is_one_line(config: Path, amqp_url: str) -> None:
    proc = splitmq("client", str(config), "--partition", "9", amqp_url=amqp_url, redis_url="")

    line = one_error_line(proc)
    assert "partition 9 outside 0..1" in line


def test_run_with_an_unknown_model_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    text = JOB_TOML.format(job="unknown-model", model="nosuch", runs=tmp_path / "runs")
    # `splitmq run` is single-process: the in-memory broker and store (no warning about them).
    path.write_text(text.replace('"rabbitmq"', '"memory"').replace('"redis"', '"memory"'))
    proc = splitmq("run", str(path), amqp_url="", redis_url="")

    line = one_error_line(proc)
    assert line.startswith("Error: unknown model 'nosuch'")


@pytest.mark.rabbitmq
def test_debug_brings_the_traceback_back(config: Path, amqp_url: str) -> None:
    proc = splitmq(
        "--debug", "client", str(config), "--id", "bad id!", amqp_url=amqp_url, redis_url=""
    )

    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ClientSettingsError" in proc.stderr
