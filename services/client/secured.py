"""A client's broker handle in the secured mode (design §3, docs/deployment.md "Security").

Each client logs in as its own RabbitMQ user, `<job>.<client>` (`identity.client_user`). Such a
user may not configure anything, so its handle only checks that the exchanges and its reply
queue exist (`splitmq provision-clients` declared them); nor publish to `splitmq.dead`, so it
dead-letters a bad reply by rejecting it, which the reply queue's own dead-letter exchange routes
to `<job>.dead`; every publish carries the user as its AMQP user_id, which RabbitMQ validates
and the services compare with the message's `client`.
`client_theta` is the same handle asking the workers for split inference (SplitGP).
"""

from __future__ import annotations

from dataclasses import replace

from broker.transport import Broker
from services.client.errors import ClientError
from services.client.inference import BrokerTheta
from services.common.backends import Backends
from services.config.root import Settings
from services.security.identity import amqp_user, client_user


def secured_client_broker(
    settings: Settings, backends: Backends, client_id: str, name: str
) -> Broker:
    """The client's handle: as `backends` opens it, or secured as above."""
    if not settings.security.per_client_users:
        return backends.open_broker(name)
    broker_settings = backends.broker_settings
    user = client_user(settings.job.name, client_id)
    if broker_settings.kind == "rabbitmq":
        found = amqp_user(broker_settings.amqp_url)
        if found != user:
            raise ClientError(
                f"client {client_id!r} of job {settings.job.name!r} logs in to RabbitMQ as "
                f"{found!r}, not {user!r}: with security.per_client_users each client must use "
                "its own user (the credentials `splitmq provision-clients` wrote for it)"
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
    """Split inference as client `client_id`: InferRequests in its name (stamped with its user
    in the secured mode), answers on its own inference reply queue, which in the secured mode is
    the durable one provisioned for it. `close` the result to close its connection."""
    broker = secured_client_broker(settings, backends, client_id, f"splitmq-infer-{client_id}")
    try:
        return BrokerTheta(
            broker,
            settings.job.name,
            requester=client_id,
            provisioned=settings.security.per_client_users,
            version=version,
            timeout_s=timeout_s,
        )
    except BaseException:
        broker.close()
        raise
