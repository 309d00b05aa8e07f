"""Exchange and queue names of design §4, built in one place."""

from __future__ import annotations

from dataclasses import dataclass, replace

from broker.transport import QueueSpec

# Topic exchanges, so that RabbitMQ's topic permissions can confine a client user of the
# secured mode to its own job's routing keys (services/security/provision.py); bindings are
# exact keys (job names and client ids hold neither '*' nor '#'), routed as by a direct
# exchange. New names, not the direct `splitmq.smashed` / `splitmq.control` of earlier
# releases: RabbitMQ refuses to re-declare an exchange as another type (PRECONDITION_FAILED).
SMASHED_EXCHANGE = "splitmq.smashed.topic"
CONTROL_EXCHANGE = "splitmq.control.topic"
REPLIES_EXCHANGE = "splitmq.replies"
EVENTS_EXCHANGE = "splitmq.events"
DEAD_EXCHANGE = "splitmq.dead"

# Events are best-effort notices for dashboards and runners: a publish that no subscriber
# receives is not an error (every other exchange publishes mandatorily).
BEST_EFFORT_EXCHANGES = frozenset({EVENTS_EXCHANGE})

# (name, type); every broker declares all of them before any queue.
EXCHANGES: tuple[tuple[str, str], ...] = (
    (SMASHED_EXCHANGE, "topic"),
    (CONTROL_EXCHANGE, "topic"),
    (REPLIES_EXCHANGE, "direct"),
    (EVENTS_EXCHANGE, "fanout"),
    (DEAD_EXCHANGE, "direct"),
)


@dataclass(frozen=True)
class QueueLimits:
    """Bounds on every durable queue of a job: a client can publish into each of them, so none
    may grow without limit. RabbitMQ (and the in-memory hub) count ready messages only.

    The shard, infer, control and updates queues refuse publishes when full (back-pressure: the
    publisher backs off and retries, nothing is silently dropped). The dead-letter queue drops
    its oldest letters instead: it is where rejection ends, so a full one refusing would make
    every later rejection lose its reason (a flood of junk could then hide the next bad message's
    reason), and the newest letters are the ones an operator looks for. Its default holds a
    10,000-message fuzz run (benchmarks/fuzz_services.py) whole.

    Every role declaring a job's queues must use equal limits: RabbitMQ refuses to re-declare a
    queue with other arguments (PRECONDITION_FAILED).
    """

    max_length: int = 10_000  # shard and infer queues
    max_length_bytes: int = 1 << 30
    control_max_length: int = 10_000  # joins, heartbeats, round notices: small messages
    control_max_length_bytes: int = 64 << 20
    updates_max_length: int = 10_000  # WeightsUpdates: a client's weights each
    updates_max_length_bytes: int = 1 << 30
    dead_max_length: int = 100_000
    dead_max_length_bytes: int = 2 << 30
    # Reply queues (`<job>.reply.<client>`, `<job>.infer-reply.<requester>`): only services
    # write to them, but every message a client sends may be answered there (a Join with a
    # Welcome holding its weights), so a client that keeps asking and never reads would grow
    # its queue without end. A legitimate client holds at most its Welcome, an assignment or
    # two, and one reply per batch in flight: fewer batches than its shard queue holds
    # (`max_length`), and room for three messages of RabbitMQ's largest (128 MiB) and their
    # gradients. Publishers are refused when full (reject-publish).
    reply_max_length: int = 10_000
    reply_max_length_bytes: int = 512 << 20
    # A client host's one queue (`<job>.host.<H>`) carries the replies of all its clients.
    host_max_length: int = 100_000
    host_max_length_bytes: int = 4 << 30


def shard_queue_name(job: str, shard: int) -> str:
    return f"{job}.smashed.{shard}"


def shard_routing_key(job: str, shard: int) -> str:
    return f"{job}.{shard}"


def control_queue_name(job: str) -> str:
    return f"{job}.control"


def updates_queue_name(job: str) -> str:
    return f"{job}.updates"


def updates_routing_key(job: str) -> str:
    return f"{job}.updates"


def dead_queue_name(job: str) -> str:
    return f"{job}.dead"


def hidden_name(name: str, hidden: str) -> str:
    """Queue `name` with a secret part appended (the secured mode's reply queues,
    services/security/hidden.py): RabbitMQ checks no permission on a passive declare, so a
    queue whose name can be guessed shows its depth to anyone. `""` keeps `name`."""
    return f"{name}.{hidden}" if hidden else name


def reply_queue_name(job: str, client: str, hidden: str = "") -> str:
    return hidden_name(f"{job}.reply.{client}", hidden)


def reply_routing_key(job: str, client: str) -> str:
    return f"{job}.{client}"


def host_queue_name(job: str, host: str, hidden: str = "") -> str:
    return hidden_name(f"{job}.host.{host}", hidden)


def infer_queue_name(job: str) -> str:
    return f"{job}.infer"


def infer_routing_key(job: str) -> str:
    # Shard keys end in a number, so no shard of any job shares this key.
    return f"{job}.infer"


def infer_reply_queue_name(job: str, requester: str, hidden: str = "") -> str:
    return hidden_name(f"{job}.infer-reply.{requester}", hidden)


def infer_reply_routing_key(job: str, requester: str) -> str:
    # Three dot-separated parts: job names and client ids have no dots, so no training reply
    # key (`<job>.<client>`) of any job equals it.
    return f"{job}.infer-reply.{requester}"


def _bounded(
    job: str, name: str, exchange: str, key: str, bounds: tuple[int, int], sac: bool = False
) -> QueueSpec:
    """A durable queue of `job` bounded by `bounds` (messages, bytes), refusing publishes when
    full, whose rejected messages go to `<job>.dead`; `sac`: with a single active consumer."""
    length, nbytes = bounds
    return QueueSpec(
        name,
        exchange,
        key,
        single_active_consumer=sac,
        max_length=length,
        max_length_bytes=nbytes,
        dead_letter_routing_key=job,
    )


def shard_queue(job: str, shard: int, limits: QueueLimits | None = None) -> QueueSpec:
    limits = limits or QueueLimits()
    key, bounds = shard_routing_key(job, shard), (limits.max_length, limits.max_length_bytes)
    return _bounded(job, shard_queue_name(job, shard), SMASHED_EXCHANGE, key, bounds, sac=True)


def infer_queue(job: str, limits: QueueLimits | None = None) -> QueueSpec:
    """InferRequests (split inference): apart from the shard queues, so a request never waits
    behind training traffic. Every worker of the job consumes it (competing consumers) on a
    connection and thread of its own (`workers.inference`)."""
    limits = limits or QueueLimits()
    bounds = (limits.max_length, limits.max_length_bytes)
    return _bounded(job, infer_queue_name(job), SMASHED_EXCHANGE, infer_routing_key(job), bounds)


def control_queue(job: str, limits: QueueLimits | None = None) -> QueueSpec:
    limits = limits or QueueLimits()
    bounds = (limits.control_max_length, limits.control_max_length_bytes)
    return _bounded(job, control_queue_name(job), CONTROL_EXCHANGE, job, bounds)


def updates_queue(job: str, limits: QueueLimits | None = None) -> QueueSpec:
    """WeightsUpdates, apart from `<job>.control` so the coordinator and the aggregator can be
    separate processes (two consumers of one queue would get each other's messages)."""
    limits = limits or QueueLimits()
    bounds = (limits.updates_max_length, limits.updates_max_length_bytes)
    return _bounded(
        job, updates_queue_name(job), CONTROL_EXCHANGE, updates_routing_key(job), bounds
    )


def events_queue(job: str, subscriber: str) -> QueueSpec:
    """One subscriber's private view of the fanout: gone when its connection closes. The
    fanout carries every job's events; subscribers filter on `Event.job`, and dead-letter
    what is no event at all to `<job>.dead`."""
    return QueueSpec(
        name=f"{job}.events.{subscriber}",
        exchange=EVENTS_EXCHANGE,
        routing_key="",
        durable=False,
        exclusive=True,
        auto_delete=True,
        dead_letter_routing_key=job,
    )


def dead_queue(job: str, limits: QueueLimits | None = None) -> QueueSpec:
    """Where every rejected message of `job` ends (bound with the job name as key): drop-head
    when full, see `QueueLimits`. `Broker.dead_letter` declares it again if it has gone."""
    limits = limits or QueueLimits()
    return QueueSpec(
        name=dead_queue_name(job),
        exchange=DEAD_EXCHANGE,
        routing_key=job,
        max_length=limits.dead_max_length,
        max_length_bytes=limits.dead_max_length_bytes,
        overflow="drop-head",
    )


def _reply_bounds(limits: QueueLimits | None) -> tuple[int, int]:
    limits = limits or QueueLimits()
    return limits.reply_max_length, limits.reply_max_length_bytes


def reply_queue(
    job: str, client: str, limits: QueueLimits | None = None, hidden: str = ""
) -> QueueSpec:
    """A client's training replies, bound with `<job>.<client>` whatever its name (`hidden`):
    the services publish by key and never need the name."""
    key = reply_routing_key(job, client)
    name = reply_queue_name(job, client, hidden)
    return _bounded(job, name, REPLIES_EXCHANGE, key, _reply_bounds(limits))


def host_queue(
    job: str,
    host: str,
    client: str | None = None,
    limits: QueueLimits | None = None,
    hidden: str = "",
) -> QueueSpec:
    """The one reply queue of a client host's clients (docs/architecture.md, "Client hosts"):
    bound with the host's own key, or, with `client`, the key of that client's replies. The
    coordinator binds each client's key when the client joins through the host (bindings add
    up; the queue's arguments are the same either way). The host's own key is the queue's
    default name, whatever its name (`hidden`, the secured mode): three dot-separated parts, so
    no training reply key (`<job>.<client>`) equals it."""
    limits = limits or QueueLimits()
    own = host_queue_name(job, host)
    name = host_queue_name(job, host, hidden)
    key = own if client is None else reply_routing_key(job, client)
    bounds = (limits.host_max_length, limits.host_max_length_bytes)
    return _bounded(job, name, REPLIES_EXCHANGE, key, bounds)


def infer_reply_queue(job: str, requester: str, limits: QueueLimits | None = None) -> QueueSpec:
    """An ad-hoc split-inference requester's private reply queue (a service user, e.g.
    `splitmq infer`): gone with its connection, as the requester's waits are. Apart from the
    training reply queue, so a client may ask for inference while its training loop consumes
    `<job>.reply.<client>`."""
    key = infer_reply_routing_key(job, requester)
    name = infer_reply_queue_name(job, requester)
    bounded = _bounded(job, name, REPLIES_EXCHANGE, key, _reply_bounds(limits))
    return replace(bounded, durable=False, exclusive=True, auto_delete=True)


def client_infer_reply_queue(
    job: str, client: str, limits: QueueLimits | None = None, hidden: str = ""
) -> QueueSpec:
    """A client user's inference reply queue in the secured mode: same binding as
    `infer_reply_queue` (its name with `hidden` appended), but durable and shared-access,
    because the client may not declare (or bind) a queue: `splitmq provision-clients` declares
    it for the client with the services' connection, and the client only checks that it
    exists."""
    private = infer_reply_queue(job, client, limits)
    name = infer_reply_queue_name(job, client, hidden)
    return replace(private, name=name, durable=True, exclusive=False, auto_delete=False)


def client_queue_names(job: str, client: str, hidden: tuple[str, str] = ("", "")) -> list[str]:
    """The queues kept for one client across connections: its training reply queue and its
    provisioned (durable) split-inference reply queue, with their `hidden` parts (secured
    mode); what removing the client removes."""
    reply, infer = hidden
    return [reply_queue_name(job, client, reply), infer_reply_queue_name(job, client, infer)]


def job_queues(job: str, shards: int, limits: QueueLimits | None = None) -> list[QueueSpec]:
    """The server-side queues of a job: dead letters first, so rejected messages have a home."""
    specs = [dead_queue(job, limits), control_queue(job, limits), updates_queue(job, limits)]
    specs.extend(shard_queue(job, s, limits) for s in range(shards))
    specs.append(infer_queue(job, limits))
    return specs
