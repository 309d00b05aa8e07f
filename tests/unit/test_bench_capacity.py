"""benchmarks/capacity.py: the message sizes the capacity model is built on are the codec's
bodies of the real messages, and its protocol count matches what a run moves."""

from __future__ import annotations

import struct

import pytest

from benchmarks.capacity import (
    Costs,
    Scenario,
    message_sizes,
    model_rows,
    predicted_messages,
    sample_messages,
)
from broker.codec import decode, encode
from broker.messages import HostHeartbeat, SmashedBatch, Welcome
from services.common.membership import HOST_HEARTBEAT_MEMBERS

ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def test_smashed_batch_body_is_header_activations_and_labels() -> None:
    smashed = sample_messages(32)["smashed"]
    body = encode(smashed)
    header = struct.unpack("<I", body[4:8])[0]
    sizes = message_sizes(32)
    # cnn5's block1 output (10 x 12 x 12 float32) for 32 images, 32 int64 labels.
    assert sizes.activations == 32 * 10 * 12 * 12 * 4
    assert sizes.labels == 32 * 8
    # Header padded to 64, the activations, the labels at the next 64-byte boundary.
    assert len(body) == _aligned(8 + header) + _aligned(sizes.activations) + sizes.labels
    assert sizes.smashed == len(body)
    decoded = decode(body, expect=SmashedBatch)
    assert decoded.activations.shape == (32, 10, 12, 12)


def test_sizes_follow_the_tensors_they_carry() -> None:
    messages = sample_messages(16)
    sizes = message_sizes(16)
    assert sizes.activations == 16 * 10 * 12 * 12 * 4
    # The gradient has the activations' shape; the reply carries no labels.
    assert sizes.activations < sizes.reply < sizes.smashed
    welcome = messages["welcome"]
    assert isinstance(welcome, Welcome)
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in (*welcome.client_weights.values(), *welcome.aux_weights.values())
    )
    assert weight_bytes < sizes.welcome < weight_bytes + 4096
    # FedAvg moves the whole model both ways; SFL's update is the client blocks only.
    assert sizes.update < sizes.assignment < sizes.fedavg_assignment
    beat = decode(encode(messages["host_heartbeat"]), expect=HostHeartbeat)
    assert len(beat.members) == HOST_HEARTBEAT_MEMBERS


def test_protocol_count_of_a_run() -> None:
    point = {
        "clients": 100, "algorithm": "sfl", "rounds": 5, "hosts": 1, "sessions": 105,
        "wall_s": 14.0,
    }  # fmt: skip
    # 2 per session, 10 sampled x (2 + 2 x 19 steps) x 5 rounds, 100 dismissals, 7 heartbeats.
    assert predicted_messages(point) == pytest.approx(210 + 5 * 10 * 40 + 100 + 7)
    fedavg = {**point, "algorithm": "fedavg"}
    assert predicted_messages(fedavg) == pytest.approx(210 + 5 * 10 * 2 + 100 + 7)


def test_model_scales_with_the_cohort() -> None:
    sizes = message_sizes(32)
    ten = dict(model_rows(Scenario(100_000, fraction=0.1), sizes, Costs()))
    one = dict(model_rows(Scenario(100_000, fraction=0.01), sizes, Costs()))
    assert ten["messages per round"] == "60,000"
    assert one["messages per round"] == "6,000"
    assert ten["client hosts (500 clients each)"] == "200"
