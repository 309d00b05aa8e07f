"""A client's broker handle in the secured mode (design §3, docs/deployment.md "Security").

Each client logs in as its own RabbitMQ user, named like the client. Such a user may not
configure anything, so its handle only checks that the exchanges and its reply queue exist
(`splitmq provision-clients` declared them); and every publish carries the user as its AMQP
user_id, which RabbitMQ validates and the services compare with the message's `client`.
`client_theta` is the same handle asking the workers for split inference (SplitGP).
"""

from __future__ import annotations

from dataclasses import replace

from broker.transport import Broker
from services.client.errors import ClientError
from services.client.inference import BrokerTheta
from services.config.root import Settings
from services.runtime.backends import Backends
from services.security.identity import amqp_user, stamped


def secured_client_broker(
    settings: Settings, backends: Backends, client_id: str, name: str
) -> Broker:
    """The client's handle: as `backends` opens it, or secured as above."""
    if not settings.security.per_client_users:
        return backends.open_broker(name)
    broker_settings = backends.broker_settings
    if broker_settings.kind == "rabbitmq":
        user = amqp_user(broker_settings.amqp_url)
        if user != client_id:
            raise ClientError(
                f"client {client_id!r} logs in to RabbitMQ as {user!r}: with "
                "security.per_client_users each client must use its own user (the credentials "
                "`splitmq provision-clients` wrote for it) and the same id"
            )
        if not broker_settings.passive_declare:
            passive = broker_settings.model_copy(update={"passive_declare": True})
            backends = replace(backends, broker_settings=passive)
    return stamped(backends.open_broker(name), client_id, True)


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
