"""CUDA: the wire layer and a worker on a GPU.

CI has no GPU, so these run only where torch sees one (the `device` tool's machine;
`scripts/gpu_check.sh` runs them there). Everything else in the suite pins or defaults to the
CPU paths; these exercise the device-to-host copies of the codec, the worker's data plane
(pinned buffers, the copy stream, decoding one delivery ahead) and a worker training the server
side on `cuda`, against the same in-process reference loop as test_exactness.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from broker.codec import decode, encode
from broker.errors import EncodeError
from broker.messages import SmashedBatch, WeightsUpdate, new_message_id
from services.common.backends import Backends, Embedded
from services.data.loaders import Dataset
from tests.integration.reference_loops import reference_run
from tests.integration.test_exactness import ROUNDS, TOLERANCE, dataset, job_settings, train
from tests.unit.test_client_peers import max_diff
from tests.unit.test_device_io import STEPS, queued
from tests.unit.test_device_io import train as train_inbox
from workers.device_io import DevicePlane

__all__ = ["dataset"]  # the module-scoped fixture, imported so that it applies here

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)"
)

EMBEDDED: dict[str, dict[str, Any]] = {"broker": {"kind": "memory"}, "store": {"kind": "memory"}}


def batch(activations: torch.Tensor) -> SmashedBatch:
    rows = activations.shape[0]
    return SmashedBatch(
        job="cuda",
        client="client-0",
        message_id=new_message_id(),
        version=1,
        seq=1,
        shard=0,
        round=0,
        step=1,
        activations=activations,
        labels=torch.arange(rows, device=activations.device) % 10,
    )


def test_codec_encodes_cuda_tensors_as_their_cpu_copies() -> None:
    cpu = torch.randn(64, 16, 14, 14)
    message = batch(cpu.cuda())
    body = encode(message)
    same = encode(replace(message, activations=cpu, labels=message.labels.cpu()))
    assert body == same
    back = decode(body)
    assert isinstance(back, SmashedBatch)
    assert torch.equal(back.activations, cpu)
    # Strided (non-contiguous) device tensors travel too.
    strided = torch.randn(16, 64, device="cuda").t()
    again = decode(encode(batch(strided)))
    assert isinstance(again, SmashedBatch)
    assert torch.equal(again.activations, strided.cpu())


def test_codec_refuses_non_finite_cuda_tensors() -> None:
    bad = torch.randn(8, 4, device="cuda")
    bad[3, 1] = float("nan")
    with pytest.raises(EncodeError, match="NaN or infinite"):
        encode(batch(bad))
    weights = {"w": torch.randn(3, 3, device="cuda"), "b": torch.full((3,), float("inf"))}
    update = WeightsUpdate(
        job="cuda",
        client="client-0",
        message_id=new_message_id(),
        version=1,
        round=0,
        samples=10,
        client_weights={"w": weights["w"]},
        aux_weights={"b": weights["b"].cuda()},
    )
    with pytest.raises(EncodeError, match="NaN or infinite"):
        encode(update)


@pytest.fixture(params=[False, True], ids=["fp32", "tf32"])
def tf32(request: pytest.FixtureRequest) -> Iterator[bool]:
    """cuDNN convolutions in full float32, or allowed TF32 as PyTorch's default does (on an
    H200 both gave 1.9e-7 here: cuDNN picked full-precision kernels for these small convs)."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = request.param
    yield request.param
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.slow
def test_cuda_worker_trains_what_the_cpu_reference_does(
    job: str, dataset: Dataset, tf32: bool
) -> None:
    settings = job_settings(job, EMBEDDED, algorithm="sfl_v2", clients=1)
    settings = settings.model_copy(
        update={"workers": settings.workers.model_copy(update={"device": "cuda"})}
    )
    backends = Backends(settings.broker, settings.store, Embedded())

    trained = train(settings, backends, dataset)
    want = reference_run(settings, dataset, ROUNDS)

    assert trained.worker.batches_applied == want.steps, trained.worker
    assert trained.worker.dead_lettered_total == 0, trained.worker
    # One client, as test_exactness's SFL-V2 case: with two, the order in which the worker
    # interleaves their batches varies from run to run. Float32 on both sides but other
    # kernels and reduction orders: measured 1.9e-7 (H200), held to test_exactness's
    # tolerance; a dropped, doubled or stale batch moves the weights by 1e-2 and more.
    server, client = max_diff(trained.server, want.server), max_diff(trained.client, want.client)
    print(f"CUDA worker (tf32={tf32}) vs CPU reference: server {server:.2e}, client {client:.2e}")
    assert server <= TOLERANCE and client <= TOLERANCE, (server, client)


# --- the worker's data plane (workers/device_io.py) ----------------------------------------------
CUDA = torch.device("cuda")  # only used once a test runs: CI skips them all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plane_stages_batches_on_the_device_and_replies_through_pinned_memory(
    dtype: torch.dtype,
) -> None:
    plane = DevicePlane(CUDA)
    z = torch.randn(64, 16, 14, 14).to(dtype)
    message = decode(encode(batch(z)))  # a view of the body, as the worker receives it
    staged = plane.ready(plane.stage(message))
    assert isinstance(staged, SmashedBatch) and staged.labels is not None
    assert staged.activations.device.type == "cuda" and staged.activations.dtype == dtype
    assert staged.labels.device.type == "cpu"  # the shard's checks read them
    assert torch.equal(staged.activations.cpu(), z)
    grad = torch.randn_like(staged.activations, dtype=torch.float32)  # the step's dL/dz
    out = plane.host(grad, dtype)
    assert out.is_pinned() and out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, grad.to(dtype).cpu())


@pytest.fixture
def deterministic_cudnn() -> Iterator[None]:
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before


def test_the_prefetch_path_trains_on_cuda_what_the_plain_path_does(
    job: str, deterministic_cudnn: None
) -> None:
    plain_hub, plain, plain_opt = queued(job)
    ahead_hub, ahead, ahead_opt = queued(job)
    seqs = list(range(STEPS))
    assert train_inbox(plain_hub, job, plain, plain_opt, ahead=False, device=CUDA) == seqs
    assert train_inbox(ahead_hub, job, ahead, ahead_opt, ahead=True, device=CUDA) == seqs
    got = ahead.state_dict()
    for name, want in plain.state_dict().items():
        assert max_diff({name: got[name]}, {name: want}) <= 1e-6, name
