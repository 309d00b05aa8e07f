"""Service end to end: every role its own OS process over real RabbitMQ and Redis.

One coordinator, one aggregator, two workers (S=2 shards, so both have work) and six clients
train cnn5 on the full Fashion-MNIST for four rounds, while the test

- starts the sixth client only after round 1 closed (version 2) and checks that it takes part
  in the rounds after that;
- SIGKILLs another client in the middle of round 3 (once a worker checkpoint shows batches of
  it applied in that round) and checks that the round closes at its deadline with the quorum,
  and that the job goes on to publish the last version;
- checks the accuracy of the global model, that the aggregator exits 0 and that no role crashed.

Waits poll the store (current version, manifests, checkpoints) with timeouts; every child is
killed in a `finally`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from broker.store import WeightStore
from services.common.backends import Backends
from services.config.loading import load_settings
from services.config.root import Settings
from services.runtime.processes import ChildSpec, child_env, clear_job
from tests.contract.test_store_contract import lease_owner

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

ROUNDS = 4
CLIENTS = 6
SHARDS = 2
DEADLINE_S = 15.0
# Well past the deadline plus a heartbeat period: the killed client stays a live member through
# its round, which can then only close by the deadline-and-quorum rule.
HEARTBEAT_TTL_S = 22.0
STEPS = 20
KILL_ROUND = 2  # 0-based: the third round, which trains version 3 into version 4
VICTIM = "client-0"
LATE = f"client-{CLIENTS - 1}"
# What may pass between the deadline and the aggregator noticing it (it polls every 0.1 s,
# and this machine is small and shared).
CLOSE_SLACK_S = 5.0

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"
# The test reads every version's manifest at the end.
keep_versions = 10

[job]
name = "set-by-env"
rounds = {rounds}
seed = 1

[model]
name = "cnn5"
cut = "block1"

[data]
dataset = "fashion_mnist"
dir = "{data_dir}"
partition = "iid"
eval_samples = 2000

[algorithm]
name = "sfl"
shards = {shards}
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = {steps}

[clients]
count = {clients}
min_to_start = {min_to_start}
heartbeat_s = 2
heartbeat_ttl_s = {ttl}

[rounds]
deadline_s = {deadline}
quorum = 0.5
replica_timeout_s = 60

[workers]
count = 2
# Frequent checkpoints: they are how the test sees that a client is in the middle of a round.
checkpoint_every_steps = 2

[report]
plots = false
"""

T = TypeVar("T")


@dataclass
class RoleProcess:
    spec: ChildSpec
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def name(self) -> str:
        return self.spec.name

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


class Roles:
    """The job's role processes, each `python -m services.cli.main <role> CONFIG ...` (as
    `splitmq up` starts them), with its output in its own log file."""

    def __init__(self, config: Path, env: Mapping[str, str], log_dir: Path) -> None:
        self._config = config
        self._env = dict(env)
        self._log_dir = log_dir
        self.started: dict[str, RoleProcess] = {}

    def start(self, spec: ChildSpec) -> RoleProcess:
        log = self._log_dir / f"{spec.name}.log"
        argv = [sys.executable, "-m", "services.cli.main", spec.role, str(self._config)]
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*argv, *spec.args],
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        role = RoleProcess(spec, process, log)
        self.started[spec.name] = role
        return role

    def check_alive(self, exempt: frozenset[str] = frozenset()) -> None:
        """Fail at once, with its log, when a role ended before its time."""
        for role in self.started.values():
            code = role.process.poll()
            if code is not None and role.name not in exempt:
                pytest.fail(f"{role.name} exited early with {code}:\n{role.output()[-4000:]}")

    def kill_all(self) -> None:
        for role in self.started.values():
            if role.process.poll() is None:
                role.process.kill()
        for role in self.started.values():
            role.process.wait(30)

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{r.output()[-1500:]}" for n, r in self.started.items())


def wait_for(
    probe: Callable[[], T | None],
    timeout_s: float,
    what: str,
    roles: Roles,
    *,
    exempt: frozenset[str] = frozenset(),
    poll_s: float = 0.1,
) -> T:
    """Poll `probe` until it returns a value; fails (with the roles' logs) on timeout or when a
    role process dies meanwhile."""
    give_up = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        roles.check_alive(exempt)
        if time.monotonic() > give_up:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{roles.tails()}")
        time.sleep(poll_s)


def participants(store: WeightStore, job: str, version: int) -> set[str]:
    """The clients whose updates went into `version` (the aggregator's manifest meta)."""
    listed = store.manifest(job, version).meta.get("participants", "")
    return {c for c in listed.split(",") if c}


def lease_owners(store: WeightStore, job: str) -> list[str] | None:
    """Who holds each shard, once every shard is held by a different worker."""
    owners = [lease_owner(store, job, f"shard:{s}") for s in range(SHARDS)]
    held = [o for o in owners if o is not None]
    return held if len(set(held)) == SHARDS else None


def victim_mid_round(store: WeightStore, job: str) -> tuple[int, int] | None:
    """(step, steps) of the victim's latest applied batch in the kill round, per the checkpoint
    of its shard; None until there is one."""
    for shard in range(SHARDS):
        checkpoint = store.load_checkpoint(job, shard)
        if checkpoint is None or checkpoint.meta.get("cohort_round") != KILL_ROUND:
            continue
        progress = checkpoint.meta.get("progress", {})
        if VICTIM in progress:
            step, steps = progress[VICTIM]
            return int(step), int(steps)
    return None


@pytest.fixture
def settings_and_env(
    tmp_path: Path, amqp_url: str, redis_url: str, job: str, data_dir: str
) -> Iterator[tuple[Path, Settings, dict[str, str]]]:
    path = tmp_path / "service.toml"
    path.write_text(
        CONFIG.format(
            amqp_url=amqp_url,
            redis_url=redis_url,
            data_dir=data_dir,
            rounds=ROUNDS,
            shards=SHARDS,
            steps=STEPS,
            clients=CLIENTS,
            min_to_start=CLIENTS - 1,
            ttl=HEARTBEAT_TTL_S,
            deadline=DEADLINE_S,
        )
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    base["SPLITMQ_JOB__NAME"] = job
    # Ten processes on a small machine: one thread each keeps them from fighting over cores.
    base["OMP_NUM_THREADS"] = "1"
    base["MKL_NUM_THREADS"] = "1"
    env = child_env(base, workers=2, clients=CLIENTS)
    settings = load_settings(path, env)
    assert settings.job.name == job and settings.shards == SHARDS
    yield path, settings, env
    clear_job(settings, [f"client-{i}" for i in range(CLIENTS)])


class Scenario:
    """Drives one run through its phases, recording when each happened."""

    def __init__(self, roles: Roles, store: WeightStore, job: str, runs: Path) -> None:
        self.roles = roles
        self.store = store
        self.job = job
        self.runs = runs
        self.dead: frozenset[str] = frozenset()
        self.timings: dict[str, float] = {}
        self.late_seen: int | None = None  # the version current when LATE was first a member
        self._t0 = time.monotonic()

    def version(self) -> int:
        return self.store.current_version(self.job)

    def mark(self, what: str) -> None:
        self.timings[what] = round(time.monotonic() - self._t0, 1)

    def wait(self, probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
        return wait_for(probe, timeout_s, what, self.roles, exempt=self.dead)

    def late_joined(self) -> bool:
        if self.late_seen is None and f"client:{LATE}" in self.store.live_members(self.job):
            self.late_seen = self.version()
        return self.late_seen is not None

    def start_services(self) -> None:
        """Aggregator, coordinator and workers, as a deployment brings them up first: wait for
        version 1 and for the two workers to hold one shard each (S=2: both have work)."""
        self.roles.start(ChildSpec("aggregator", "aggregator", ("--report-dir", str(self.runs))))
        self.roles.start(ChildSpec("coordinator", "coordinator"))
        for i in range(2):
            self.roles.start(ChildSpec(f"worker-{i}", "worker", ("--id", f"worker-{i}")))
        owners = self.wait(
            lambda: lease_owners(self.store, self.job) if self.version() >= 1 else None,
            120,
            "version 1 and one shard per worker",
        )
        assert sorted(owners) == ["worker-0", "worker-1"], owners
        self.mark("services up")

    def start_client(self, i: int) -> None:
        name = f"client-{i}"
        self.roles.start(ChildSpec(name, "client", ("--id", name, "--partition", str(i))))

    def kill_victim_mid_round(self) -> None:
        """SIGKILL the victim once its shard's checkpoint shows batches of it applied in the
        kill round; its absence from that round's participants (asserted at the end) shows
        the kill came before its update."""
        step, steps = self.wait(
            lambda: victim_mid_round(self.store, self.job),
            60,
            f"{VICTIM} training round {KILL_ROUND + 1}",
        )
        self.roles.started[VICTIM].process.send_signal(signal.SIGKILL)
        self.dead = frozenset({VICTIM})
        self.mark("victim killed")
        assert 0 <= step < steps == STEPS

    def hold_until_late_joined(self, aggregator: RoleProcess) -> None:
        """Keep the aggregator from opening the next round until the late client is a member.

        Starting a client (Python, torch, the dataset: ~10 CPU-s) takes longer than a round
        when other work shares the machine's two cores, and a job whose last round opened
        first would leave it nothing to join. The hold (SIGSTOP, then SIGCONT) makes the
        order certain: it is taken right after a version appears, while the aggregator
        evaluates it, before it opens the next round (were it late, that round would just run
        without the late client, which the assertions allow for).
        """
        aggregator.process.send_signal(signal.SIGSTOP)
        self.mark("aggregator held")
        try:
            self.wait(lambda: self.late_joined() or None, 180, f"{LATE} to join")
        finally:
            aggregator.process.send_signal(signal.SIGCONT)
        self.mark(f"{LATE} joined")

    def finish(self, aggregator: RoleProcess) -> None:
        """The aggregator ends the job and exits 0; the clients leave on their own; the
        coordinator and workers stop cleanly on SIGTERM; nothing crashed."""
        clients = {f"client-{i}" for i in range(CLIENTS)}
        wait_for(
            lambda: aggregator.process.poll() is not None or None,
            180,
            "the aggregator to finish",
            self.roles,
            exempt=self.dead | clients | {"aggregator"},
            poll_s=0.2,
        )
        self.mark("aggregator exited")
        assert aggregator.process.returncode == 0, aggregator.output()[-4000:]
        for name in sorted(clients - self.dead):
            self.expect_exit(name, 60)
        self.mark("clients exited")
        services = ("coordinator", "worker-0", "worker-1")
        for name in services:
            process = self.roles.started[name].process
            assert process.poll() is None, f"{name} ended on its own:\n{self.roles.tails()}"
            process.send_signal(signal.SIGTERM)
        for name in services:
            self.expect_exit(name, 30)
        self.mark("all stopped")
        assert self.roles.started[VICTIM].process.returncode == -signal.SIGKILL
        for name, role in self.roles.started.items():
            assert "Traceback" not in role.output(), f"{name} crashed:\n{role.output()[-4000:]}"

    def expect_exit(self, name: str, timeout_s: float) -> None:
        role = self.roles.started[name]
        code = role.process.wait(timeout_s)
        assert code == 0, f"{name} exited {code}:\n{role.output()[-3000:]}"


@pytest.mark.timeout(360)
def test_service_end_to_end(
    settings_and_env: tuple[Path, Settings, dict[str, str]], tmp_path: Path, job: str
) -> None:
    config, settings, env = settings_and_env
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    logs.mkdir()
    roles = Roles(config, env, logs)
    store = Backends(settings.broker, settings.store).open_store()
    run = Scenario(roles, store, job, runs)
    try:
        run.start_services()
        aggregator = roles.started["aggregator"]
        for i in range(CLIENTS - 1):
            run.start_client(i)
        # Round 1 closed: only now does the sixth client exist.
        wait_for(
            lambda: run.version() >= 2 or None,
            180,
            "version 2 (round 1 closed)",
            roles,
            poll_s=0.02,  # the hold must come before the aggregator opens round 2
        )
        run.mark("v2")
        run.start_client(CLIENTS - 1)
        run.hold_until_late_joined(aggregator)
        run.kill_victim_mid_round()
        run.finish(aggregator)

        last = ROUNDS + 1
        assert run.version() == last
        (run_dir,) = runs.iterdir()
        doc = json.loads((run_dir / "metrics.json").read_text())
        assert doc["run"]["status"] == "finished"
        records = {r["version"]: r for r in doc["records"]}
        members = {v: participants(store, job, v) for v in range(2, last + 1)}
        report(run.timings, records, members)
    finally:
        roles.kill_all()
        store.close()

    # Every version published by its round, with the participants its manifest names.
    assert sorted(records) == list(range(2, last + 1))
    for v, record in records.items():
        assert record["round"] == v - 1  # counted from 1: version v closes round v - 1
        assert record["participants"] == len(members[v]) > 0

    # Learning: well above chance (10 %) after three rounds, and no collapse afterwards.
    assert records[4]["global_accuracy"] >= 0.70, records
    assert records[5]["global_accuracy"] >= 0.70, records

    # Round 1 had the five first clients, none of them late.
    assert members[2] == {f"client-{i}" for i in range(CLIENTS - 1)}

    # The killed client: its round closed at the deadline with a quorum, without it, and the job
    # went on to publish every later version without it too.
    killed = KILL_ROUND + 2
    assert VICTIM in members[killed - 1]
    assert all(VICTIM not in members[v] for v in range(killed, last + 1)), members
    assert len(members[killed]) >= CLIENTS / 2
    round_s = records[killed]["extra"]["round_s"]
    assert DEADLINE_S <= round_s <= DEADLINE_S + CLOSE_SLACK_S, records[killed]

    # The late client: absent from round 1, then in every round from its first on, and that
    # first round no later than the first one opened after it was seen as a member.
    assert run.late_seen == 2
    joined = [v for v in range(3, last + 1) if LATE in members[v]]
    assert joined and joined == list(range(joined[0], last + 1)), members
    assert joined[0] <= run.late_seen + 2, members


def report(
    timings: Mapping[str, float],
    records: Mapping[int, Mapping[str, Any]],
    members: Mapping[int, set[str]],
) -> None:
    """Shown with `pytest -s`: when each phase happened and what each version got."""
    print(f"\nservice e2e timings (s): {json.dumps(timings)}")
    for v, r in sorted(records.items()):
        print(
            f"  v{v}: accuracy {r['global_accuracy']:.3f}, round {r['extra']['round_s']:.1f} s, "
            f"participants {sorted(members.get(v, ()))}"
        )
