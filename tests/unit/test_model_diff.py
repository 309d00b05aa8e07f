"""`compare_models`: bit equality, the largest differences, and what cannot be compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.report.model_diff import compare_models, diff_report


def files(
    tmp_path: Path, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> tuple[Path, Path]:
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(a, str(pa))
    save_file(b, str(pb))
    return pa, pb


def test_equal_files_are_bit_identical(tmp_path: Path) -> None:
    w = {"w": torch.randn(3, 4), "n": torch.tensor([1, 2, 3])}
    diffs = compare_models(*files(tmp_path, w, {k: v.clone() for k, v in w.items()}))
    assert all(d.identical for d in diffs) and len(diffs) == 2
    assert diff_report(diffs) == "bit-identical: all 2 tensors"


def test_one_ulp_is_found_with_its_size(tmp_path: Path) -> None:
    w = torch.ones(5)
    moved = w.clone()
    moved[2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    (d,) = compare_models(*files(tmp_path, {"w": w}, {"w": moved}))
    assert not d.identical
    assert d.max_abs == pytest.approx(2**-23)
    assert d.max_rel == pytest.approx(2**-23)
    assert "1 of 1 tensors differ" in diff_report([d])


def test_negative_zero_is_not_bit_identical(tmp_path: Path) -> None:
    # Equal as numbers, not as bits: a replay that is "close" must not be called identical.
    (d,) = compare_models(*files(tmp_path, {"z": torch.zeros(1)}, {"z": -torch.zeros(1)}))
    assert not d.identical and d.max_abs == 0.0


def test_missing_and_reshaped_tensors_are_reported_first(tmp_path: Path) -> None:
    a = {"same": torch.ones(2), "gone": torch.ones(2), "shape": torch.ones(2)}
    b = {"same": torch.ones(2), "shape": torch.ones(1, 2)}
    diffs = compare_models(*files(tmp_path, a, b))
    assert [d.name for d in diffs] == ["gone", "shape", "same"]
    assert "missing from the replay's model" in diffs[0].note
    assert diffs[0].max_abs == float("inf")


def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"bad\.safetensors: not a readable safetensors file"):
        compare_models(bad, bad)


def test_model_files_have_their_metadata_in_one_order(tmp_path: Path) -> None:
    # safetensors writes metadata from a Rust HashMap: its order changes between processes.
    from safetensors import safe_open

    from services.report.final_model import write_state

    state = {"w": torch.arange(6.0).reshape(2, 3)}
    meta = {f"key{i}": str(i) for i in range(12)}
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    write_state(paths[0], state, meta)
    write_state(paths[1], state, dict(reversed(list(meta.items()))))
    assert paths[0].read_bytes() == paths[1].read_bytes()
    with safe_open(str(paths[0]), "pt") as f:
        assert f.metadata() == {"format": "pt", **meta}
        assert torch.equal(f.get_tensor("w"), state["w"])
