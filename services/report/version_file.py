"""The last published version of an embedded run, blob by blob, in its run directory.

`splitmq run` keeps its versions in an in-memory store that dies with the process, so the run
directory keeps the newest one as `version.safetensors`: every blob under `<part>:<owner>:<name>`
(a part and an owner hold no ':'), with the version number, the manifest's samples and meta in
the file's metadata. `splitmq run --resume` publishes it again as the current version of a fresh
store (`InMemoryWeightStore.restore_version`). `VersionKeeper` rewrites it, in one step, after
each version's metrics row, so a run stopped or killed at any point leaves a version no older
than one round behind its metrics (`resume.prepare_resume` drops a row the file lacks).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from broker.errors import SplitMQError
from broker.store import BlobRef, VersionStore
from services.report.final_model import write_state
from services.report.records import VersionRecord

VERSION_FILE = "version.safetensors"


@dataclass(frozen=True)
class SavedVersion:
    """A version as a run directory keeps it: what `restore_version` publishes again."""

    job: str
    version: int
    blobs: dict[BlobRef, dict[str, torch.Tensor]]
    samples: dict[BlobRef, int]
    meta: dict[str, str]


def save_version(run_dir: Path, store: VersionStore, job: str, version: int) -> Path:
    """Write `version` of `job` from `store` as `run_dir/VERSION_FILE`, replaced in one step."""
    manifest = store.manifest(job, version)
    tensors: dict[str, torch.Tensor] = {}
    for ref in sorted(manifest.entries):
        for name, tensor in store.read_blob(job, version, ref).items():
            tensors[f"{ref.name}:{name}"] = tensor
    metadata = {
        "job": job,
        "version": str(version),
        # Every blob by name, also one without tensors, with its samples.
        "samples": json.dumps({r.name: e.samples for r, e in sorted(manifest.entries.items())}),
        "meta": json.dumps(dict(manifest.meta)),
    }
    return write_state(run_dir / VERSION_FILE, tensors, metadata)


def load_version(path: Path) -> SavedVersion:
    """The version a run directory kept; `ValueError` saying what is wrong with the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        samples = {_ref(name): int(n) for name, n in json.loads(metadata["samples"]).items()}
        meta = {str(k): str(v) for k, v in json.loads(metadata["meta"]).items()}
        saved = SavedVersion(
            metadata["job"], int(metadata["version"]), {ref: {} for ref in samples}, samples, meta
        )
    except (OSError, SafetensorError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a version SplitMQ wrote: {exc}") from None
    for key, tensor in tensors.items():
        part, owner, name = key.split(":", 2)
        blob = saved.blobs.get(BlobRef(part, owner))
        if blob is None:
            raise ValueError(f"{path}: tensor {key!r} of a blob its metadata does not list")
        blob[name] = tensor
    return saved


def _ref(name: str) -> BlobRef:
    part, owner = name.split(":")
    return BlobRef(part, owner)


class VersionKeeper:
    """A MetricsSink that keeps each recorded version in the run directory (after the row:
    in a `TeeSink` behind the `FileSink`); a failure is logged, the run goes on."""

    def __init__(self, store: VersionStore, job: str, run_dir: Path, log: logging.Logger) -> None:
        self._store = store
        self._job = job
        self._run_dir = run_dir
        self._log = log

    def record(self, record: VersionRecord) -> None:
        try:
            save_version(self._run_dir, self._store, self._job, record.version)
        except (SplitMQError, OSError, ValueError) as exc:
            self._log.warning(
                "could not keep version %d in %s for --resume: %s",
                record.version,
                self._run_dir,
                exc,
            )

    def finish(self, status: str) -> None:
        pass
