"""The control queue's checks (services/coordinator/checks.py, hosts.py), alone and as each
message type's chain, with hand-built deliveries."""

from __future__ import annotations

from broker.messages import Heartbeat, HostHeartbeat, Join, Leave
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.chain import first_rejection
from services.common.membership import HOST_HEARTBEAT_MEMBERS
from services.coordinator.checks import ControlChecks, client_role
from services.coordinator.hosts import HostSender, host_members, join_host
from services.security.identity import SenderCheck, client_user, host_user


def delivery(user: str | None = None) -> Delivery:
    return Delivery(b"", "j.control", "j", 1, user_id=user)


def beat(members: dict[str, int], host: str = "edge") -> HostHeartbeat:
    return HostHeartbeat("j", host, "m", 0, members)


def test_a_heartbeat_of_another_role_than_client_is_refused() -> None:
    assert client_role(delivery(), Heartbeat("j", "a", "m", 0)) is None
    assert client_role(delivery(), Heartbeat("j", "a", "m", 0, role="worker")) == Rejection(
        "not_client", "heartbeat of role 'worker': only clients are members"
    )


def test_a_host_heartbeat_comes_from_its_host_and_lists_its_own_clients() -> None:
    sender = HostSender(SenderCheck(job="j"))
    assert sender(delivery(host_user("j", "edge")), beat({"edge-0": 1})) is None
    assert sender(delivery(), beat({}, host="bad host")) is not None
    refused = sender(delivery(host_user("j", "core")), beat({}))
    assert refused is not None and refused.detail == (
        "host 'edge' does not match the AMQP user 'j.host.core'"
    )
    assert host_members(delivery(), beat({"edge-0": 1, "edge-12": 3})) is None
    many = {f"edge-{i}": 1 for i in range(HOST_HEARTBEAT_MEMBERS + 1)}
    refused = host_members(delivery(), beat(many))
    assert refused is not None and refused.code == "too_many_members"
    stranger = host_members(delivery(), beat({"edge-0": 1, "core-0": 1}))
    assert stranger == Rejection(
        "not_its_clients",
        "HostHeartbeat of host 'edge' lists 1 clients not its own (edge-<n>), e.g. 'core-0'",
    )


def test_a_join_through_a_host_names_a_host_of_its_own() -> None:
    def join(info: dict[str, str]) -> Join:
        return Join("j", "edge-0", "m", 0, 10, 0, info)

    assert join_host(delivery(), join({})) is None
    assert join_host(delivery(), join({"host": "edge"})) is None
    refused = join_host(delivery(), join({"host": "core"}))
    assert refused is not None and refused.code == "bad_host"
    assert "a host's clients are core-<n>" in refused.detail


def test_each_message_type_has_its_chain_in_order() -> None:
    checks = ControlChecks.of("j", SenderCheck(job="j"))
    mallory = delivery(client_user("j", "mallory"))
    other_job = Leave("k", "", "m", 0)  # of another job, and without a client id: the job first
    assert first_rejection(checks.leave, mallory, other_job) == Rejection(
        "wrong_job", "message for job 'k' on job 'j''s control queue"
    )
    assert first_rejection(checks.heartbeat, mallory, Heartbeat("j", "", "m", 0)) == Rejection(
        "no_client", "Heartbeat without a client id"
    )
    refused = first_rejection(checks.join, mallory, Join("j", "a b", "m", 0, 1))
    assert refused is not None and refused.detail.startswith("client id 'a b' is not")
    refused = first_rejection(checks.heartbeat, mallory, Heartbeat("j", "a", "m", 0, role="w"))
    assert refused is not None and refused.detail == (
        "client 'a' does not match the AMQP user 'j.mallory'"
    )
    own = delivery(client_user("j", "a"))
    assert first_rejection(checks.heartbeat, own, Heartbeat("j", "a", "m", 0)) is None
    assert first_rejection(checks.leave, own, Leave("j", "a", "m", 0)) is None
    refused = first_rejection(checks.join, own, Join("j", "a", "m", 0, 1, 0, {"host": "edge"}))
    assert refused is not None and refused.code == "bad_host"
    host = delivery(host_user("j", "edge"))
    assert first_rejection(checks.host_heartbeat, host, beat({"edge-1": 1})) is None
    assert first_rejection(checks.host_heartbeat, own, beat({"edge-1": 1})) is not None
