"""Issue 36 (b): a distributed run replays bit for bit. `splitmq up` over the real RabbitMQ and
Redis, two workers and four clients; the worker holding shard 0 is SIGKILLed in the middle of
round 2 (after a checkpoint, so batches it applied are lost with it and redelivered); `up`
restarts it, a worker (the other, or the restarted one) takes the shard over from its
checkpoint (SFL-V2 has one server-side model: one shard, one holder), the job finishes; then
`splitmq replay RUN_DIR --check` reaches the run's model.safetensors bit for bit. The second
test adds a client that leaves after its round 1 (SIGTERM) and rejoins under its id and
partition as a `splitmq client` of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest
import redis

from broker.keys import lease_key
from services.common.backends import Backends
from services.common.leases import lease_name
from services.common.schedule import (
    COORDINATOR_STREAM,
    Applied,
    MemberEvent,
    Restored,
    decode,
    shard_stream,
)
from services.common.schedule_file import SCHEDULE_FILE, read_schedule_file
from services.config.loading import load_settings
from services.config.root import Settings
from services.runtime.processes import child_env, clear_job

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

CLIENTS = 4
ROUNDS = 3
LEAVER = f"client-{CLIENTS - 1}"

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"

[job]
name = "set-by-env"
seed = 5
rounds = {rounds}

[model]
name = "cnn5"
cut = "block1"
num_classes = 10

[data]
dataset = "fashion_mnist_sample"
eval_samples = 200

[algorithm]
name = "sfl_v2"
batch_size = 16
lr = 0.05
max_steps_per_round = 15

[clients]
count = {clients}
min_to_start = {clients}
start_timeout_s = 180.0
# Eight processes import torch at once on a shared machine: be patient with heartbeats.
heartbeat_ttl_s = 60.0

[rounds]
# Every round waits for its whole cohort: none closes early on a quorum.
deadline_s = 300.0

[workers]
count = 2
device = "cpu"
checkpoint_every_steps = 5
# Checkpoints by steps only, so the kill lands between two of them.
checkpoint_every_s = 3600.0
# The successor takes shard 0 over within seconds of the kill.
lease_ttl_s = 3.0

[metrics]
enabled = false

[report]
plots = false
"""


@pytest.fixture
def job_config(tmp_path: Path, amqp_url: str, redis_url: str, job: str) -> Iterator[Settings]:
    path = tmp_path / "service.toml"
    path.write_text(
        CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, rounds=ROUNDS, clients=CLIENTS)
    )
    settings = load_settings(path, {"SPLITMQ_JOB__NAME": job})
    yield settings
    clear_job(settings, [f"client-{i}" for i in range(CLIENTS)])


def role_env(job: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["SPLITMQ_JOB__NAME"] = job
    return env


def splitmq(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """`splitmq ARGS` in the background, its output into `log` (appended)."""
    with log.open("a") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def shard_entries(settings: Settings, shard: int) -> list[object]:
    """Shard `shard`'s schedule entries in the store so far (flushed with each checkpoint)."""
    backends = Backends(settings.broker, settings.store)
    with closing(backends.open_store()) as store:
        lines = store.read_schedule(settings.job.name).get(shard_stream(shard), [])
    return [decode(line) for line in lines]


def wait_for(what: str, ready: Callable[[], bool], up: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        if up.poll() is not None:
            pytest.fail(f"`up` ended before {what}:\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"never {what}:\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


def child_with_id(parent: int, member: str) -> int:
    """The pid of `up`'s child whose command line has `--id member` (the aggregator, which
    has no id: the one running `aggregator`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid != parent:
            continue
        if member == "aggregator" and "aggregator" in argv:
            return int(entry.name)
        if "--id" in argv and argv[argv.index("--id") + 1] == member:
            return int(entry.name)
    raise AssertionError(f"no child of {parent} runs with --id {member}")


def second_round_checkpointed(settings: Settings) -> bool:
    """Shard 0 checkpointed (and so flushed its record) within the job's second round."""
    rounds = {e.round for e in shard_entries(settings, 0) if isinstance(e, Applied)}
    return len(rounds) >= 2


def run_up(
    settings: Settings, tmp_path: Path, redis_url: str, *, leave_and_rejoin: bool
) -> tuple[Path, str, int]:
    """Run the job under `up`, SIGKILL shard 0's holder in round 2 (and, with
    `leave_and_rejoin`, stop LEAVER after its round 1 and start it again as a process of its
    own, welcomed before the kill); the run directory, `up`'s output and the Restored
    entries shard 0 had before the kill."""
    job = settings.job.name
    runs, log = tmp_path / "runs", tmp_path / "up.log"
    config = tmp_path / "service.toml"
    args = ["up", str(config), "--workers", "2", "--clients", str(CLIENTS)]
    up = splitmq([*args, "--report-dir", str(runs), "--timeout", "600"], role_env(job), log)
    rejoined: subprocess.Popen[str] | None = None
    try:
        if leave_and_rejoin:
            done = f"client {LEAVER}: round 1 done"
            wait_for(f"{LEAVER} finished round 1", lambda: done in log.read_text(), up, log)
            os.kill(child_with_id(up.pid, LEAVER), signal.SIGTERM)
            # Started again at once (as `up` starts its clients: its environment, the same id
            # and partition), and welcomed before the kill. The aggregator is paused
            # (SIGSTOP) meanwhile: the rounds go on without the client that left, and a
            # loaded machine takes longer to start a client than the job takes to end.
            env = child_env(role_env(job), workers=2, clients=CLIENTS, runtime=settings.runtime)
            client = ["client", str(config), "--id", LEAVER, "--partition", str(CLIENTS - 1)]
            again = tmp_path / "rejoined.log"
            wait_for(f"{LEAVER} stopped", lambda: f"{LEAVER} left" in log.read_text(), up, log)
            aggregator = child_with_id(up.pid, "aggregator")
            os.kill(aggregator, signal.SIGSTOP)
            try:
                rejoined = splitmq(client, env, again)
                welcomed = f"client {LEAVER}: welcomed"
                wait_for(f"{LEAVER} rejoined", lambda: welcomed in again.read_text(), up, log)
            finally:
                os.kill(aggregator, signal.SIGCONT)
        wait_for("round 2 checkpointed on shard 0", lambda: second_round_checkpointed(settings),
                 up, log)  # fmt: skip
        restored_before = sum(isinstance(e, Restored) for e in shard_entries(settings, 0))
        with closing(redis.Redis.from_url(redis_url)) as db:
            owner = db.get(lease_key(job, lease_name(0)))
        assert isinstance(owner, bytes), "nobody holds shard 0's lease"
        holder = owner.decode()
        os.kill(child_with_id(up.pid, holder), signal.SIGKILL)
        up.wait(timeout=600)
    finally:
        for process in (up, rejoined):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT if process is up else signal.SIGTERM)
                process.wait(timeout=60)
    out = log.read_text()
    assert up.returncode == 0, out[-6000:]
    assert f"{holder} exited with code -9; restarting it (1 of 3)" in out
    (run_dir,) = runs.iterdir()
    assert json.loads((run_dir / "metrics.json").read_text())["run"]["status"] == "finished"
    return run_dir, out, restored_before


def replay_check(run_dir: Path, job: str) -> str:
    replay = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "replay", str(run_dir), "--check"],
        env=role_env(job),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    said = replay.stdout + replay.stderr
    assert replay.returncode == 0, said[-6000:]
    assert "record: reproduced" in said
    assert "model: bit-identical" in said
    return said


@pytest.mark.timeout(900)
def test_an_up_run_with_a_killed_worker_replays_bit_for_bit(
    job_config: Settings, tmp_path: Path, redis_url: str, job: str
) -> None:
    run_dir, _, restored_before = run_up(job_config, tmp_path, redis_url, leave_and_rejoin=False)
    record = read_schedule_file(run_dir / SCHEDULE_FILE)
    restored = [e for e in record.streams[shard_stream(0)] if isinstance(e, Restored)]
    assert len(restored) > restored_before, "no worker took shard 0 over from its checkpoint"
    replay_check(run_dir, job)


@pytest.mark.timeout(900)
def test_an_up_run_with_a_client_leaving_and_rejoining_replays_bit_for_bit(
    job_config: Settings, tmp_path: Path, redis_url: str, job: str
) -> None:
    run_dir, _, restored_before = run_up(job_config, tmp_path, redis_url, leave_and_rejoin=True)
    record = read_schedule_file(run_dir / SCHEDULE_FILE)
    restored = [e for e in record.streams[shard_stream(0)] if isinstance(e, Restored)]
    assert len(restored) > restored_before, "no worker took shard 0 over from its checkpoint"
    events = [
        e.kind
        for e in record.streams[COORDINATOR_STREAM]
        if isinstance(e, MemberEvent) and e.client == LEAVER
    ]
    assert events[:3] == ["join", "leave", "join"], events
    replay_check(run_dir, job)
