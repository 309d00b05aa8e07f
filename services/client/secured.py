"""A client's (or client host's) broker handle in the secured mode: its own user, passive
declares, dead letters by rejection, its user stamped on every publish (docs/deployment.md,
"Security").
"""

from __future__ import annotations

from dataclasses import replace

from broker.transport import Broker
from services.client.errors import ClientError
from services.client.inference import BrokerTheta
from services.common.backends import Backends
from services.config.root import Settings
from services.security.hidden import queue_secret
from services.security.identity import amqp_user, client_user, host_user


def secured_client_broker(
    settings: Settings, backends: Backends, client_id: str, name: str
) -> Broker:
    user = client_user(settings.job.name, client_id)
    return _confined(settings, backends, user, f"client {client_id!r}", name)


def secured_host_broker(settings: Settings, backends: Backends, host: str, name: str) -> Broker:
    """A client host's handle: in the secured mode it logs in as the host's own user
    (`splitmq provision-clients --hosts`), which reads only the host's queue."""
    user = host_user(settings.job.name, host)
    return _confined(settings, backends, user, f"client host {host!r}", name)


def _confined(settings: Settings, backends: Backends, user: str, who: str, name: str) -> Broker:
    if not settings.security.per_client_users:
        return backends.open_broker(name)
    broker_settings = backends.broker_settings
    if broker_settings.kind == "rabbitmq":
        found = amqp_user(broker_settings.amqp_url)
        if found != user:
            raise ClientError(
                f"{who} of job {settings.job.name!r} logs in to RabbitMQ as {found!r}, not "
                f"{user!r}: with security.per_client_users each client and client host must "
                "use its own user (the credentials `splitmq provision-clients` wrote for it)"
            )
        # It may neither configure nor publish to splitmq.dead (its permissions, provision.py).
        confined = {"passive_declare": True, "dead_letter_by_nack": True}
        backends = replace(backends, broker_settings=broker_settings.model_copy(update=confined))
    return backends.open_broker(name, stamp=user)


def client_theta(
    settings: Settings,
    backends: Backends,
    client_id: str,
    *,
    version: int = 0,
    timeout_s: float = 30.0,
) -> BrokerTheta:
    """Split inference as client `client_id` (docs/deployment.md, "Security"); `close` the
    result to close its connection."""
    broker = secured_client_broker(settings, backends, client_id, f"splitmq-infer-{client_id}")
    try:
        return BrokerTheta(
            broker,
            settings.job.name,
            requester=client_id,
            provisioned=settings.security.per_client_users,
            secret=queue_secret(
                settings.security.per_client_users, backends.broker_settings.amqp_url
            ),
            version=version,
            timeout_s=timeout_s,
        )
    except BaseException:
        broker.close()
        raise
