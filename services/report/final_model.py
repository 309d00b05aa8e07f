"""The trained model a run keeps: its last version's weights in the run directory.

`model.safetensors` holds the global model, `personal/<client>.safetensors` each client's own
model where the algorithm keeps personal blobs (`client/<id>`, `aux/<id>`). Each file is the
whole `SplitNet`'s state under `model.state_dict()` names, so `load_state_dict` takes it as it
is; entries a version does not carry (the auxiliary heads of an algorithm that trains none)
keep the seeded initial values of the template the caller passes (version 1's model).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save

from broker.store import GLOBAL_OWNER, NO_VERSION, VersionStore
from models.split import SplitNet
from services.algorithms.base import VersionWeights, full_model_weights
from services.report.rundir import write_atomic

MODEL_FILE = "model.safetensors"
PERSONAL_DIR = "personal"


def version_blobs(store: VersionStore, job: str, version: int) -> VersionWeights:
    """Every blob of a version, each verified against its manifest."""
    manifest = store.manifest(job, version)
    return {ref: store.read_blob(job, version, ref) for ref in sorted(manifest.entries)}


def personal_owners(blobs: VersionWeights) -> list[str]:
    """The clients that have weights of their own in a version, sorted."""
    return sorted({ref.owner for ref in blobs if ref.owner != GLOBAL_OWNER})


def assembled_state(
    template: SplitNet, blobs: VersionWeights, client: str | None = None
) -> dict[str, torch.Tensor]:
    """The whole model of a version (with `client`: that client's), as `template.state_dict()`
    names it; `ValueError` when a blob holds a name or shape the template lacks (another model)."""
    state = {name: t.detach().clone() for name, t in template.state_dict().items()}
    weights = full_model_weights(blobs, client)
    misfits = sorted(
        name
        for name, t in weights.items()
        if name not in state or tuple(t.shape) != tuple(state[name].shape)
    )
    if misfits:
        raise ValueError(
            f"the version's weights do not fit the model: {len(misfits)} names unknown or "
            f"of another shape, e.g. {misfits[:3]}"
        )
    state.update(weights)
    return state


def write_state(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """`state` as a safetensors file, replaced in one step (a crash leaves no half file)."""
    # safetensors refuses tensors that share storage; own contiguous copies never do.
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    data = save(tensors, metadata={"format": "pt", **metadata})
    return write_atomic(path, sorted_metadata(data))


def sorted_metadata(data: bytes) -> bytes:
    """`data` (safetensors bytes) with its metadata's keys in sorted order: safetensors writes
    them from a Rust HashMap, in an order that changes from process to process, and two runs
    of one seed must give the same file byte for byte (issue 36). Same keys, same length."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    meta = header.get("__metadata__")
    if not meta:
        return data
    header["__metadata__"] = dict(sorted(meta.items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > size:  # never: the same content, reordered; keep what safetensors wrote
        return data
    return data[:8] + text.ljust(size, b" ") + data[8 + size :]


def save_final_model(
    run_dir: Path, store: VersionStore, job: str, template: SplitNet
) -> list[Path]:
    """Write the job's current version into `run_dir`; the files written ([] before version 1).

    The global model is `MODEL_FILE`, every personal model `PERSONAL_DIR/<client>.safetensors`.
    """
    version = store.current_version(job)
    if version == NO_VERSION:
        return []
    blobs = version_blobs(store, job, version)
    meta = {"job": job, "version": str(version)}
    written = [write_state(run_dir / MODEL_FILE, assembled_state(template, blobs), meta)]
    for client in personal_owners(blobs):
        if Path(client).name != client or client.startswith("."):
            raise ValueError(f"client id {client!r} is not a file name")
        state = assembled_state(template, blobs, client)
        path = run_dir / PERSONAL_DIR / f"{client}.safetensors"
        written.append(write_state(path, state, {**meta, "client": client}))
    return written
