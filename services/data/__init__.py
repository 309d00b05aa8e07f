"""The data layer: dataset loading, client partitioning and per-client minibatches.

- ``registry``: the known datasets (files per split, channels, normalisation).
- ``loaders``: ``load_dataset(name, data_dir)`` -> normalised NCHW float32 tensors.
- ``idx`` / ``npz``: validated readers for the two on-disk formats.
- ``partition``: IID, Dirichlet, shards and MiniBatch-SFL label-ratio splits; local test sets.
- ``batches``: seeded per-client minibatch iteration over preloaded tensors.
- ``sample``: the Fashion-MNIST sample shipped with the package (built by ``make_sample``).

The dispatcher ``partition.partition(labels, spec)`` is deliberately not re-exported here:
a package attribute named ``partition`` would shadow the ``partition`` submodule.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.data.batches import Batch, ClientBatches, epoch_order
    from services.data.errors import (
        DataError,
        DataFormatError,
        DatasetNotFoundError,
        PartitionError,
        UnknownDatasetError,
    )
    from services.data.loaders import (
        DATA_DIR_ENV,
        Dataset,
        Split,
        load_dataset,
        load_split_arrays,
        resolve_data_dir,
        to_tensor,
    )
    from services.data.partition import (
        PartitionSpec,
        client_classes,
        dirichlet,
        iid,
        label_counts,
        label_ratio,
        local_test_indices,
        shards,
    )
    from services.data.registry import DATASETS, DatasetSpec, get_spec

__all__ = [
    "DATASETS",
    "DATA_DIR_ENV",
    "Batch",
    "ClientBatches",
    "DataError",
    "DataFormatError",
    "Dataset",
    "DatasetNotFoundError",
    "DatasetSpec",
    "PartitionError",
    "PartitionSpec",
    "Split",
    "UnknownDatasetError",
    "client_classes",
    "dirichlet",
    "epoch_order",
    "get_spec",
    "iid",
    "label_counts",
    "label_ratio",
    "load_dataset",
    "load_split_arrays",
    "local_test_indices",
    "resolve_data_dir",
    "shards",
    "to_tensor",
]

# Importing `services.data.errors` runs this file first, and the config imports the errors: the
# names below load their submodules (numpy, torch) on first use, so that reading a config (the
# `splitmq check` healthcheck, `splitmq --help`) does not import torch.
_HOMES = {
    "Batch": "batches",
    "ClientBatches": "batches",
    "epoch_order": "batches",
    "DataError": "errors",
    "DataFormatError": "errors",
    "DatasetNotFoundError": "errors",
    "PartitionError": "errors",
    "UnknownDatasetError": "errors",
    "DATA_DIR_ENV": "loaders",
    "Dataset": "loaders",
    "Split": "loaders",
    "load_dataset": "loaders",
    "load_split_arrays": "loaders",
    "resolve_data_dir": "loaders",
    "to_tensor": "loaders",
    "PartitionSpec": "partition",
    "client_classes": "partition",
    "dirichlet": "partition",
    "iid": "partition",
    "label_counts": "partition",
    "label_ratio": "partition",
    "local_test_indices": "partition",
    "shards": "partition",
    "DATASETS": "registry",
    "DatasetSpec": "registry",
    "get_spec": "registry",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
