"""Weights <-> safetensors bytes, validated both ways (safetensors decoding cannot execute code:
docs/deployment.md, "No code from the wire"). Both directions reject dtypes outside a whitelist
and non-finite floating values: a NaN published as a version would poison every replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from broker.errors import DecodeError, EncodeError
from broker.tensors import BY_TORCH, all_finite

# The dtypes a message may carry (`broker.tensors.WIRE_DTYPES`), so a blob never holds one the
# wire refuses.
ALLOWED_DTYPES: frozenset[torch.dtype] = frozenset(BY_TORCH)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _problem(name: str, tensor: torch.Tensor) -> str | None:
    if tensor.dtype not in ALLOWED_DTYPES:
        return f"tensor {name!r} has unsupported dtype {tensor.dtype}"
    if tensor.is_floating_point() and not all_finite(tensor):
        return f"tensor {name!r} has non-finite values"
    return None


def encode_weights(weights: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of `weights`; `EncodeError` on bad names, dtypes or non-finite values."""
    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in weights.items():
        if not isinstance(name, str) or not name:
            raise EncodeError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise EncodeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.layout is not torch.strided:
            raise EncodeError(f"tensor {name!r} has unsupported layout {tensor.layout}")
        problem = _problem(name, tensor)
        if problem is not None:
            raise EncodeError(problem)
        t = tensor.detach().cpu().contiguous()
        # safetensors refuses tensors sharing storage (tied weights, views); the copy is only
        # paid for the second and later users of a storage.
        ptr = t.untyped_storage().data_ptr()
        if t.numel() > 0 and ptr in seen_storages:
            t = t.clone()
        elif t.numel() > 0:
            seen_storages.add(ptr)
        prepared[name] = t
    try:
        return _st_save(prepared, metadata={"format": "pt"})
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise EncodeError(f"cannot serialise weights: {exc}") from exc


def decode_weights(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors blob; `DecodeError` if it is malformed or fails validation."""
    if not isinstance(data, bytes):
        raise DecodeError(f"weight blob must be bytes, got {type(data).__name__}")
    try:
        tensors = _st_load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError) as exc:
        raise DecodeError(f"not a valid safetensors blob: {exc}") from exc
    for name, tensor in tensors.items():
        problem = _problem(name, tensor)
        if problem is not None:
            raise DecodeError(problem)
    return tensors


def decode_verified(data: bytes, sha256: str, nbytes: int, what: str) -> dict[str, torch.Tensor]:
    """Decode a stored blob after checking it is exactly the bytes its manifest names."""
    if len(data) != nbytes:
        raise DecodeError(f"{what}: size {len(data)} != recorded size {nbytes}")
    if sha256_hex(data) != sha256:
        raise DecodeError(f"{what}: sha256 mismatch, the stored blob is corrupt")
    return decode_weights(data)
