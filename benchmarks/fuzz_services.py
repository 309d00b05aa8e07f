"""Fuzz every queue the services consume while a real training run goes on.

The real roles (aggregator, coordinator, worker with its split-inference server, clients, and a
dashboard's events watcher) run on threads of this process, each with its own connections to a
real RabbitMQ and Redis, training SplitGP (so the infer queue has consumers) on the Fashion-MNIST
sample. Once the clients have joined, a fuzzer on its own connection sends `--messages` bad and
replayed messages, spread over the queues: the shard queue, the infer queue, the control and
updates queues, each client's reply queue and the events fanout. Each is
(benchmarks/fuzz_mutations.py):

- a mutation of a valid encoded message of any type (byte flips, truncation, dtype, shape and
  field changes, NaN/Inf, bad magic, lying lengths...), which the codec refuses: REJECT;
- a well-formed message that is wrong where it is sent (wrong job, type, shard, shape, cut,
  labels, client id; unknown clients; bad tensor names; forged round markers...): REJECT;
- a replay of real traffic captured by tap queues (exact, or with a bit of tensor data flipped):
  TOLERATE, unless the codec refuses the flip (then REJECT).

The fuzz must be over before the job's last round opens, which is left for draining (its end
stops the consumers of the updates and reply queues); if training is faster, the run fails and
says so: raise `--rounds` or `--steps`. At the end: every role thread must have finished
without an exception and the inference thread must still be alive (0 crashes); every REJECT
message must be in `<job>.dead` with an `x-splitmq-reason`; the clients' batches must equal
the worker's applied batches (replays never applied twice); and the run must reach an
accuracy well above chance.

    python -m benchmarks.fuzz_services --messages 10000 --rounds 10 --steps 80   # the full run
    python -m benchmarks.fuzz_services --messages 1000 --json out.json

tests/chaos/test_fuzz_services.py runs a small one; docs/reliability.md has the full one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.fuzz_mutations import (
    REJECT,
    TOLERATE,
    Context,
    Fuzzed,
    control_cases,
    event_cases,
    flipped_data,
    infer_cases,
    mutations,
    reply_cases,
    sample_messages,
    shard_cases,
    update_cases,
)
from broker.codec import decode, encode
from broker.errors import BackPressureError, DecodeError, UnroutableError
from broker.messages import Leave
from broker.store import CLIENT_PART, BlobRef, WeightStore
from broker.topology import (
    CONTROL_EXCHANGE,
    EVENTS_EXCHANGE,
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    dead_queue_name,
    infer_routing_key,
    reply_routing_key,
    shard_routing_key,
    updates_routing_key,
)
from broker.transport import REASON_HEADER, Broker, PublishOptions, QueueSpec
from services.common.backends import Backends
from services.common.jobdata import load_job_dataset
from services.common.membership import client_members
from services.common.supervise import RoleSpec
from services.config.root import Settings
from services.dashboard.state import DashboardState
from services.dashboard.watch import JobWatcher
from services.report.records import VersionRecord
from services.runtime.processes import clear_job
from services.runtime.roles import embedded_roles

LOG = logging.getLogger("splitmq.fuzz")
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CUT = "block1"
SEEDS_PER_QUEUE = 64  # real messages kept per tapped queue, to replay and mutate
REFRESH = 40  # uses of a target's semantic cases before they are made afresh
NO_REASON = "(no x-splitmq-reason:"
FUZZ_PREFIX = "fz-"  # the AMQP message id of every fuzz message: fz-<index>
# Reason prefixes that name a class of problem (the rest of a reason is details).
_REASON_CLASSES = (
    "undecodable",
    "does not belong",
    "is not an Event",
    "is no answer",
    "for job",
    "for client",
    "is not 1-64 letters",
    "does not match the AMQP user",
    "no AMQP user_id",
    "has no reply queue",
    "unknown client",
    "who is not a member",
    "is not open",
    "is closed",
    "is not in round",
    "unknown tensors",
    "only clients are members",
    "without a client id",
    NO_REASON,
)


@dataclass(frozen=True)
class FuzzConfig:
    messages: int = 1000
    rate: float = 150.0  # messages per second
    seed: int = 0
    clients: int = 2
    rounds: int = 3
    steps: int = 30
    amqp_url: str = DEFAULT_AMQP_URL
    redis_url: str = DEFAULT_REDIS_URL
    job: str = ""
    timeout_s: float = 600.0


def job_settings(cfg: FuzzConfig, job: str) -> Settings:
    return Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": cfg.amqp_url},
            "store": {"kind": "redis", "redis_url": cfg.redis_url},
            "job": {"name": job, "seed": cfg.seed, "rounds": cfg.rounds},
            "model": {"name": "cnn5", "cut": CUT},
            "data": {"dataset": "fashion_mnist_sample", "partition": "iid", "eval_samples": 500},
            "algorithm": {
                "name": "splitgp",
                "shards": 1,
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
                "max_steps_per_round": cfg.steps,
            },
            "clients": {
                "count": cfg.clients,
                "min_to_start": cfg.clients,
                "heartbeat_s": 2,
                "heartbeat_ttl_s": 60,
                "reply_timeout_s": 30,
            },
            "rounds": {"deadline_s": 300, "quorum": 1.0, "replica_timeout_s": 120},
            "workers": {"count": 1, "checkpoint_every_steps": 10},
            "report": {"plots": False},
        }
    )


# --- role threads -------------------------------------------------------------------------------


@dataclass
class RoleThread:
    spec: RoleSpec
    stop: threading.Event
    result: object = None
    error: str = ""
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._main, name=self.spec.name, daemon=True)

    def _main(self) -> None:
        try:
            self.result = self.spec.role.run(self.stop)
        except BaseException as exc:  # a crash: reported, never swallowed
            self.error = f"{type(exc).__name__}: {exc}"
            LOG.exception("%s crashed", self.spec.name)


class CrashLog(logging.Handler):
    """ERROR records that carry a traceback: a role (or its inference thread) gave up."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.crashes: list[str] = []
        self.errors: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.errors[record.name] += 1
        if record.exc_info:
            self.crashes.append(f"{record.name}: {record.getMessage()}")


# --- taps: real traffic to replay ---------------------------------------------------------------


class Taps:
    """Private queues bound next to the real ones: copies of real traffic, kept per queue."""

    def __init__(self, broker: Broker, bindings: dict[str, tuple[str, str]]) -> None:
        self._broker = broker
        self._names: dict[str, str] = {}
        self.seen: dict[str, deque[bytes]] = {}
        for target, (exchange, key) in bindings.items():
            name = f"splitmq.fuzztap.{uuid.uuid4().hex[:12]}"
            spec = QueueSpec(name, exchange, key, durable=False, exclusive=True, auto_delete=True)
            broker.declare([spec])
            broker.subscribe(name, prefetch=256)
            self._names[name] = target
            self.seen[target] = deque(maxlen=SEEDS_PER_QUEUE)

    def pump(self) -> None:
        while (delivery := self._broker.get(0.0)) is not None:
            self._broker.ack(delivery)
            target = self._names.get(delivery.queue)
            if (delivery.message_id or "").startswith(FUZZ_PREFIX):
                continue  # our own fuzz, not real traffic
            if target is not None and replayable(delivery.body):
                self.seen[target].append(delivery.body)

    def close(self) -> None:
        for name in self._names:
            self._broker.unsubscribe(name)


def replayable(body: bytes) -> bool:
    """Real traffic worth replaying: not a Leave (which would really end a membership)."""
    try:
        return not isinstance(decode(body), Leave)
    except DecodeError:
        return False


# --- the fuzzer ---------------------------------------------------------------------------------


@dataclass
class Sent:
    target: str
    kind: str
    expect: str


@dataclass
class Target:
    name: str
    exchange: str
    key: str
    make_cases: Callable[[random.Random], list[Fuzzed]]
    _cases: list[Fuzzed] = field(default_factory=list)
    _uses: int = 0

    def semantic(self, rng: random.Random) -> Fuzzed:
        """One of its well-formed-but-wrong messages (fresh ones every `REFRESH` uses: new
        ghost ids, seqs and versions)."""
        if not self._cases or self._uses >= REFRESH:
            self._cases, self._uses = self.make_cases(rng), 0
        self._uses += 1
        return rng.choice(self._cases)


class Fuzzer:
    def __init__(
        self,
        broker: Broker,
        targets: Sequence[Target],
        seeds: Sequence[bytes],
        taps: Taps,
        rng: random.Random,
    ) -> None:
        self._broker = broker
        self._targets = list(targets)
        self._seeds = list(seeds)
        self._taps = taps
        self._rng = rng
        self.sent: dict[str, Sent] = {}
        self.unroutable = 0

    def one(self, index: int) -> None:
        rng = self._rng
        target = rng.choice(self._targets)
        real = self._taps.seen.get(target.name)
        draw = rng.random()
        if real and draw < 0.15:
            body = rng.choice(real)
            fuzzed = Fuzzed("replay", body, TOLERATE) if rng.random() < 0.5 else None
            fuzzed = fuzzed or flipped_data(rng, body)
        elif draw < 0.55:
            fuzzed = target.semantic(rng)
        else:
            pool = [*self._seeds, *(real or ())]
            fuzzed = mutations(rng, rng.choice(pool))
        message_id = f"{FUZZ_PREFIX}{index}"
        self._publish(target, fuzzed, message_id)
        self.sent[message_id] = Sent(target.name, fuzzed.kind, fuzzed.expect)

    def _publish(self, target: Target, fuzzed: Fuzzed, message_id: str) -> None:
        delay = 0.05
        while True:
            try:
                # Transient: nothing of it is worth a disk write, and it doubles the pace.
                self._broker.publish(
                    target.exchange,
                    target.key,
                    fuzzed.body,
                    PublishOptions(message_id=message_id, persistent=False),
                )
                return
            except BackPressureError:
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
            except UnroutableError:
                self.unroutable += 1
                return


# --- one run ------------------------------------------------------------------------------------


@dataclass
class Report:
    job: str
    messages: int
    sent_by_target: dict[str, int]
    sent_by_kind: dict[str, int]
    reject: int
    tolerate: int
    rejected_dead_lettered: int
    rejected_missing: list[str]
    rejected_without_reason: list[str]
    tolerated_dead_lettered: int
    reasons: dict[str, int]
    tolerated_reasons: dict[str, int]
    other_dead_letters: dict[str, int]
    samples: dict[str, list[str]]
    role_errors: dict[str, str]
    crashes: list[str]
    error_logs: dict[str, int]
    inference_alive: bool
    unroutable: int
    fuzz_s: float
    run_s: float
    finished_before_fuzz_ended: bool
    batches_sent: int
    batches_applied: int
    duplicates_skipped: int
    worker_dead_lettered: dict[str, int]
    final_accuracy: float
    versions: int

    @property
    def ok(self) -> bool:
        return (
            not self.role_errors
            and not self.crashes
            and self.inference_alive
            and not self.rejected_missing
            and not self.rejected_without_reason
            and self.batches_sent == self.batches_applied
            and not self.finished_before_fuzz_ended
            and self.unroutable == 0
        )


def reason_code(reason: str) -> str:
    """The class of a reason, for the summary: a worker's code ("bad_shape: ..."), else the
    phrase of `_REASON_CLASSES` it contains, else its start."""
    head = reason.split(":", 1)[0].strip()
    if head and " " not in head:
        return head
    found = next((phrase for phrase in _REASON_CLASSES if phrase in reason), None)
    return found or reason[:48]


def run(cfg: FuzzConfig) -> Report:
    job = cfg.job or f"fuzz{uuid.uuid4().hex[:8]}"
    settings = job_settings(cfg, job)
    clients = [f"client-{i}" for i in range(cfg.clients)]
    clear_job(settings, clients)
    crash_log = CrashLog()
    logging.getLogger().addHandler(crash_log)
    backends = Backends(settings.broker, settings.store)
    dataset = load_job_dataset(settings)
    records: list[VersionRecord] = []

    class Sink:
        def record(self, record: VersionRecord) -> None:
            records.append(record)

        def finish(self, status: str) -> None:
            LOG.info("job %s: %s", job, status)

    stop = threading.Event()
    state = DashboardState(job)
    watcher = JobWatcher(settings, backends, state=state)
    watch_stop = threading.Event()
    watch_thread = threading.Thread(target=watcher.run, args=(watch_stop,), name="watcher")
    watch_thread.start()
    roles = [RoleThread(spec, stop) for spec in embedded_roles(settings, backends, Sink(), dataset)]
    started = time.monotonic()
    for role in roles:
        role.thread.start()
    fuzz_broker = backends.open_broker("splitmq-fuzzer")
    store = backends.open_store()
    aggregator = next(r for r in roles if r.spec.kind == "aggregator")
    fuzz_s = 0.0
    fuzzer: Fuzzer | None = None
    finished_early = False
    inference_alive = False
    try:
        _wait(lambda: len(client_members(store, job)) == cfg.clients, cfg.timeout_s, "clients")
        _wait(lambda: bool(state.snapshot()["events"]), cfg.timeout_s, "the events watcher")
        taps = Taps(
            fuzz_broker,
            {
                "shard": (SMASHED_EXCHANGE, shard_routing_key(job, 0)),
                "control": (CONTROL_EXCHANGE, job),
                "updates": (CONTROL_EXCHANGE, updates_routing_key(job)),
                **{f"reply:{c}": (REPLIES_EXCHANGE, reply_routing_key(job, c)) for c in clients},
            },
        )
        version = store.current_version(job)
        client_weights = store.read_blob(job, version, BlobRef(CLIENT_PART))
        ctx = Context(
            job,
            tuple(_cut_shape(settings)),
            settings.model.num_classes,
            {n: t for n, t in client_weights.items() if n.startswith("blocks.0")},
            tuple(clients),
        )
        rng = random.Random(cfg.seed)
        seeds = [encode(m) for c in clients for m in sample_messages(ctx, c, rng)]
        fuzzer = Fuzzer(fuzz_broker, targets_of(ctx, store), seeds, taps, rng)
        fuzz_started = time.monotonic()
        for index in range(cfg.messages):
            # The last round is left for draining: its end stops the consumers of the updates
            # and reply queues, and what is sent after that would never be judged.
            if index % 20 == 0 and store.current_version(job) >= cfg.rounds:
                finished_early = True
                LOG.error("job %s: the last round opened after %d messages", job, index)
                break
            taps.pump()
            fuzzer.one(index)
            ahead = fuzz_started + (index + 1) / cfg.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        fuzz_s = time.monotonic() - fuzz_started
        taps.close()
        LOG.info("job %s: %d fuzz messages sent in %.1f s", job, cfg.messages, fuzz_s)
        inference_alive = any(t.name.startswith("infer-") for t in threading.enumerate())
        aggregator.thread.join(max(1.0, cfg.timeout_s - (time.monotonic() - started)))
        inference_alive = inference_alive and any(
            t.name.startswith("infer-") for t in threading.enumerate()
        )
    finally:
        stop.set()
        for role in roles:
            role.thread.join(60.0)
        watch_stop.set()
        watch_thread.join(30.0)
        logging.getLogger().removeHandler(crash_log)
    run_s = time.monotonic() - started
    try:
        dead = drain_dead(fuzz_broker, job)
    finally:
        fuzz_broker.close()
        store.close()
    report = summarise(cfg, job, fuzzer, dead, roles, crash_log, records)
    report.fuzz_s, report.run_s = round(fuzz_s, 1), round(run_s, 1)
    report.inference_alive = inference_alive
    report.finished_before_fuzz_ended = finished_early or any(r.thread.is_alive() for r in roles)
    clear_job(settings, clients)
    return report


def targets_of(ctx: Context, store: WeightStore) -> list[Target]:
    """Every queue the services consume, with its well-formed-but-wrong messages."""
    job = ctx.job

    def shard(r: random.Random) -> list[Fuzzed]:
        return shard_cases(ctx, 0, r, store.current_version(job))

    def reply(client: str) -> Callable[[random.Random], list[Fuzzed]]:
        return lambda r: reply_cases(ctx, client, r)

    return [
        Target("shard", SMASHED_EXCHANGE, shard_routing_key(job, 0), shard),
        Target("infer", SMASHED_EXCHANGE, infer_routing_key(job), lambda r: infer_cases(ctx, r)),
        Target("control", CONTROL_EXCHANGE, job, lambda r: control_cases(ctx, r)),
        Target(
            "updates", CONTROL_EXCHANGE, updates_routing_key(job), lambda r: update_cases(ctx, r)
        ),
        Target("events", EVENTS_EXCHANGE, "", lambda r: event_cases(ctx, r)),
        *(
            Target(f"reply:{c}", REPLIES_EXCHANGE, reply_routing_key(job, c), reply(c))
            for c in ctx.members
        ),
    ]


def _cut_shape(settings: Settings) -> tuple[int, ...]:
    from services.common.jobmodel import job_model

    return tuple(job_model(settings).cut_shape(CUT))


def _wait(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def drain_dead(broker: Broker, job: str) -> dict[str, list[str]]:
    """message id → the reasons it was dead-lettered with ("" for none)."""
    queue = dead_queue_name(job)
    broker.subscribe(queue, prefetch=500)
    found: dict[str, list[str]] = {}
    while (delivery := broker.get(2.0)) is not None:
        broker.ack(delivery)
        if delivery.queue != queue:
            continue  # a tap's last copies
        reason = str(delivery.headers.get(REASON_HEADER, ""))
        if not reason:  # dead-lettered by RabbitMQ itself: say how
            first = delivery.headers.get("x-first-death-reason", "?")
            queue = delivery.headers.get("x-first-death-queue", "?")
            reason = f"{NO_REASON} RabbitMQ {first!s} on {queue!s})"
        found.setdefault(delivery.message_id or "", []).append(reason)
    return found


def summarise(
    cfg: FuzzConfig,
    job: str,
    fuzzer: Fuzzer | None,
    dead: dict[str, list[str]],
    roles: Sequence[RoleThread],
    crash_log: CrashLog,
    records: Sequence[VersionRecord],
) -> Report:
    sent = fuzzer.sent if fuzzer else {}
    reject = {m: s for m, s in sent.items() if s.expect == REJECT}
    missing = sorted(m for m in reject if m not in dead)
    no_reason = sorted(m for m in reject if any(r.startswith(NO_REASON) for r in dead.get(m, [])))
    reasons = Counter(reason_code(r) for m in reject for r in dead.get(m, []))
    tolerated = Counter(
        reason_code(r) for m, s in sent.items() if s.expect == TOLERATE for r in dead.get(m, [])
    )
    others = Counter(reason_code(r) for m, rs in dead.items() if m not in sent for r in rs)
    clients = [r.result for r in roles if r.spec.kind == "client" and r.result is not None]
    workers = [r.result for r in roles if r.spec.kind == "worker" and r.result is not None]
    worker_dead: Counter[str] = Counter()
    for w in workers:
        worker_dead.update(getattr(w, "dead_lettered", {}))
    return Report(
        job=job,
        messages=len(sent),
        sent_by_target=dict(Counter(s.target.split(":")[0] for s in sent.values())),
        sent_by_kind=dict(Counter(s.kind for s in sent.values()).most_common()),
        reject=len(reject),
        tolerate=len(sent) - len(reject),
        rejected_dead_lettered=sum(1 for m in reject if m in dead),
        rejected_missing=[f"{m} {reject[m].target} {reject[m].kind}" for m in missing],
        rejected_without_reason=no_reason,
        tolerated_dead_lettered=sum(
            1 for m, s in sent.items() if s.expect == TOLERATE and m in dead
        ),
        reasons=dict(reasons.most_common()),
        tolerated_reasons=dict(tolerated.most_common()),
        other_dead_letters=dict(others.most_common()),
        samples={
            "others": [f"{m}: {r}" for m, rs in dead.items() if m not in sent for r in rs][:8],
            "without_reason": [f"{m} {reject[m].kind}: {dead[m]}" for m in no_reason][:8],
        },
        role_errors={r.spec.name: r.error for r in roles if r.error},
        crashes=list(crash_log.crashes),
        error_logs=dict(crash_log.errors),
        inference_alive=False,
        unroutable=fuzzer.unroutable if fuzzer else 0,
        fuzz_s=0.0,
        run_s=0.0,
        finished_before_fuzz_ended=False,
        batches_sent=sum(getattr(c, "batches_sent", 0) for c in clients),
        batches_applied=sum(getattr(w, "batches_applied", 0) for w in workers),
        duplicates_skipped=sum(getattr(w, "duplicates_skipped", 0) for w in workers),
        worker_dead_lettered=dict(worker_dead),
        final_accuracy=records[-1].global_accuracy if records else 0.0,
        versions=len(records),
    )


def markdown(report: Report, cfg: FuzzConfig) -> str:
    lines = [
        f"- messages sent: {report.messages} ({report.reject} bad, {report.tolerate} replays) "
        f"in {report.fuzz_s} s, during a run of {report.run_s} s",
        f"- per queue: {report.sent_by_target}",
        f"- per kind: {report.sent_by_kind}",
        f"- bad messages dead-lettered with a reason: {report.rejected_dead_lettered} of "
        f"{report.reject} (missing {len(report.rejected_missing)}, without reason "
        f"{len(report.rejected_without_reason)})",
        f"- replays dead-lettered (their flip broke them only semantically): "
        f"{report.tolerated_dead_lettered} of {report.tolerate}",
        f"- crashes: {len(report.crashes) + len(report.role_errors)} (role errors "
        f"{report.role_errors or 'none'}, inference thread alive: {report.inference_alive})",
        f"- batches sent by clients {report.batches_sent}, applied by the worker "
        f"{report.batches_applied}, duplicates skipped {report.duplicates_skipped}",
        f"- final global accuracy {report.final_accuracy:.4f} after {report.versions} versions "
        f"(chance: 0.10)",
        f"- dead-letter reasons: {report.reasons}",
        f"- other dead letters (not fuzz): {report.other_dead_letters or 'none'}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=FuzzConfig.messages)
    parser.add_argument("--rate", type=float, default=FuzzConfig.rate)
    parser.add_argument("--seed", type=int, default=FuzzConfig.seed)
    parser.add_argument("--clients", type=int, default=FuzzConfig.clients)
    parser.add_argument("--rounds", type=int, default=FuzzConfig.rounds)
    parser.add_argument("--steps", type=int, default=FuzzConfig.steps)
    parser.add_argument("--json", default="", help="write the report here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    LOG.setLevel(logging.INFO)
    torch.set_num_threads(1)
    cfg = FuzzConfig(
        messages=args.messages,
        rate=args.rate,
        seed=args.seed,
        clients=args.clients,
        rounds=args.rounds,
        steps=args.steps,
        amqp_url=os.environ.get("SPLITMQ_AMQP_URL", DEFAULT_AMQP_URL),
        redis_url=os.environ.get("SPLITMQ_REDIS_URL", DEFAULT_REDIS_URL),
    )
    report = run(cfg)
    print(markdown(report, cfg))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**asdict(report), "ok": report.ok, "config": asdict(cfg)}, fh, indent=2)
    print("OK" if report.ok else "FAILED")
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
