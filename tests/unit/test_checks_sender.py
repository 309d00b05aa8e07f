"""Sender identity checks (services/common/checks/sender.py), with hand-built deliveries."""

from __future__ import annotations

from broker.messages import Heartbeat, RoundStart
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.sender import ClientIdShape, ClientSender, NamesClient, ServiceSender
from services.security.identity import SenderCheck, client_id_problem, client_user, host_user


def delivery(user: str | None = None) -> Delivery:
    return Delivery(b"", "j.control", "j", 1, user_id=user)


def beat(client: str) -> Heartbeat:
    return Heartbeat("j", client, "m", 0)


def test_a_message_without_a_client_id_is_refused() -> None:
    assert NamesClient("bad_client")(delivery(), beat("a")) is None
    assert NamesClient("bad_client")(delivery(), beat("")) == Rejection(
        "bad_client", "Heartbeat without a client id"
    )


def test_a_client_id_must_be_a_plain_id() -> None:
    check = ClientIdShape("bad_sender")
    assert check(delivery(), beat("edge-0")) is None
    for bad in ("", "a b", "a.b", "x" * 65, "çlient"):
        refused = check(delivery(), beat(bad))
        assert refused is not None and refused.code == "bad_sender", bad
        assert "is not 1-64 letters, digits, '_' or '-'" in refused.detail
    for client in ("a", "A_b-9", "x" * 64, "x" * 65, "a\n", "", "é"):  # the same rule, always
        passes = check(delivery(), beat(client)) is None
        assert passes == (client_id_problem(client) is None), client


def test_the_amqp_user_must_be_the_clients_or_its_hosts() -> None:
    open_mode = ClientSender(SenderCheck(job="j"), "impostor")
    assert open_mode(delivery(), beat("a")) is None  # no user: the open mode takes its word
    assert open_mode(delivery(client_user("j", "a")), beat("a")) is None
    assert open_mode(delivery(host_user("j", "edge")), beat("edge-3")) is None
    assert open_mode(delivery(client_user("j", "b")), beat("a")) == Rejection(
        "impostor", "client 'a' does not match the AMQP user 'j.b'"
    )
    secured = ClientSender(SenderCheck(secured=True, job="j"), "impostor")
    refused = secured(delivery(), beat("a"))
    assert refused is not None and "the secured mode" in refused.detail


def test_a_service_message_must_come_from_a_service_user_in_the_secured_mode() -> None:
    marker = RoundStart("j", "", "m", 1, 0, 0, {"a": 1})
    secured = ServiceSender(SenderCheck(True, frozenset({"svc"}), "j"), "impostor")
    assert secured(delivery("svc"), marker) is None
    refused = secured(delivery(client_user("j", "a")), marker)
    assert refused is not None and refused.code == "impostor"
    assert refused.detail.startswith("RoundStart from AMQP user 'j.a'")
    assert ServiceSender(SenderCheck(job="j"), "impostor")(delivery("x"), marker) is None


def test_a_senders_verdict_is_kept_per_user_and_client() -> None:
    asked: list[tuple[str | None, str]] = []

    class Counting(SenderCheck):
        def client_problem(self, delivery: Delivery, client: str) -> str | None:
            asked.append((delivery.user_id, client))
            return super().client_problem(delivery, client)

    check = ClientSender(Counting(job="j"), "impostor")
    for _ in range(3):
        assert check(delivery(client_user("j", "a")), beat("a")) is None
        assert check(delivery(client_user("j", "b")), beat("a")) is not None
    assert asked == [("j.a", "a"), ("j.b", "a")]
