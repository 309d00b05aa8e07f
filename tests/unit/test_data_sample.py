"""The Fashion-MNIST sample shipped in services/data/sample/."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner

from scripts.make_sample import build_sample, main
from services.data.loaders import load_dataset, load_split_arrays
from services.data.registry import SAMPLE_DIR, get_spec

SAMPLE = SAMPLE_DIR / "fashion_mnist_sample.npz"


def test_sample_is_small_and_loads_without_any_data_dir() -> None:
    assert SAMPLE.stat().st_size < 4 * 1024 * 1024
    ds = load_dataset("fashion_mnist_sample", env={})
    assert ds.root == SAMPLE_DIR
    assert ds.train.x.shape == (6000, 1, 28, 28) and ds.test.x.shape == (1000, 1, 28, 28)
    assert ds.train.x.dtype == torch.float32 and ds.train.y.dtype == torch.int64
    assert torch.bincount(ds.train.y, minlength=10).tolist() == [600] * 10
    assert torch.bincount(ds.test.y, minlength=10).tolist() == [100] * 10
    # A random balanced subset keeps the full set's statistics, so normalisation still fits.
    assert abs(float(ds.train.x.mean())) < 0.05
    assert abs(float(ds.train.x.std()) - 1.0) < 0.05


def test_sample_is_a_faithful_subset_of_the_official_data(data_dir: str) -> None:
    spec = get_spec("fashion_mnist")
    with np.load(SAMPLE, allow_pickle=False) as sample:
        for which in ("train", "test"):
            x, y = load_split_arrays(spec, which, data_dir)
            index = sample[f"{which}_index"]
            assert len(np.unique(index)) == len(index)
            np.testing.assert_array_equal(sample[f"x_{which}"], x[index])
            np.testing.assert_array_equal(sample[f"y_{which}"], y[index])


def test_make_sample_reproduces_the_shipped_file(data_dir: str, tmp_path: Path) -> None:
    out = build_sample(data_dir, tmp_path / "rebuilt.npz")
    with np.load(out) as rebuilt, np.load(SAMPLE) as shipped:
        assert sorted(rebuilt.files) == sorted(shipped.files)
        for key in shipped.files:
            np.testing.assert_array_equal(rebuilt[key], shipped[key])


def test_make_sample_cli_small_variant(data_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "tiny" / "fashion_mnist_sample.npz"
    result = CliRunner().invoke(
        main, [data_dir, str(out), "--per-class-train", "3", "--per-class-test", "2", "--seed", "5"]
    )
    assert result.exit_code == 0, result.output
    ds = load_dataset("fashion_mnist_sample", out.parent, env={})
    assert torch.bincount(ds.train.y).tolist() == [3] * 10
    assert torch.bincount(ds.test.y).tolist() == [2] * 10
