"""The generic datasets: `.npz` of any shape and class count, folders of images, and what the
rest of SplitMQ does with them (partitions, the model's input shape, the class check)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from models.errors import ModelSpecError
from services.common.jobdata import check_fits, job_input_shape, load_job_dataset
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.arrays import LabelledArrays
from services.data.errors import DataFormatError, DatasetNotFoundError, UnknownDatasetError
from services.data.loaders import input_shape, load_data
from services.data.partition import PartitionKind, partition
from services.data.plugins import Loader
from services.data.registry import Augmentation
from services.data.request import DataRequest
from services.runtime.doctor import Check, check_data

RNG = np.random.default_rng(7)


def npz_request(path: Path, **kw: Any) -> DataRequest:
    return replace(DataRequest(dataset="npz", path=str(path)), **kw)


def write_splits(path: Path, x_train: np.ndarray, y_train: np.ndarray, n_test: int = 10) -> None:
    x_test = x_train[:n_test].copy()
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_train[:n_test])


# --- npz --------------------------------------------------------------------------------------


def test_npz_nhwc_uint8_non_square_is_normalised_with_measured_statistics(tmp_path: Path) -> None:
    x = RNG.integers(0, 256, size=(60, 6, 10, 3), dtype=np.uint8)
    y = np.arange(60) % 3
    write_splits(tmp_path / "d.npz", x, y)
    ds = load_data(npz_request(tmp_path / "d.npz"))
    assert ds.info.input_shape == (3, 6, 10)
    assert ds.train.x.shape == (60, 3, 6, 10) and ds.test.x.shape == (10, 3, 6, 10)
    assert ds.info.num_classes == 3 and ds.info.class_names == ("0", "1", "2")
    per_channel = ds.train.x.transpose(0, 1).reshape(3, -1)
    np.testing.assert_allclose(per_channel.mean(1).numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(per_channel.std(1, unbiased=False).numpy(), 1.0, atol=1e-4)
    mean = x[..., 1].mean() / 255.0
    assert ds.info.mean[1] == pytest.approx(mean, abs=1e-9)
    assert input_shape(npz_request(tmp_path / "d.npz")) == (3, 6, 10)


def test_npz_nchw_float_with_given_constants(tmp_path: Path) -> None:
    x = RNG.random((40, 2, 5, 5)).astype(np.float32)
    y = np.arange(40) % 4
    write_splits(tmp_path / "f.npz", x, y)
    ds = load_data(npz_request(tmp_path / "f.npz", mean=(0.5, 0.25), std=(0.5, 0.25)))
    assert ds.info.input_shape == (2, 5, 5)
    expected = (x[:, 1] - 0.25) / 0.25
    np.testing.assert_allclose(ds.train.x[:, 1].numpy(), expected, rtol=1e-5, atol=1e-5)
    raw = load_data(npz_request(tmp_path / "f.npz", normalize=False))
    np.testing.assert_array_equal(raw.train.x.numpy(), x)
    assert raw.info.mean == ()


def test_npz_grayscale_nhw(tmp_path: Path) -> None:
    x = RNG.integers(0, 256, size=(30, 7, 9), dtype=np.uint8)
    write_splits(tmp_path / "g.npz", x, np.arange(30) % 2)
    ds = load_data(npz_request(tmp_path / "g.npz", normalize=False))
    assert ds.info.input_shape == (1, 7, 9)
    np.testing.assert_allclose(ds.train.x[:, 0].numpy(), x / 255.0, atol=1e-7)


def test_npz_feature_vectors_are_used_as_given(tmp_path: Path) -> None:
    x = RNG.normal(size=(50, 12)).astype(np.float64)
    y = np.arange(50) % 5
    write_splits(tmp_path / "t.npz", x, y)
    ds = load_data(npz_request(tmp_path / "t.npz"))
    assert ds.info.input_shape == (12,) and not ds.info.is_image
    assert ds.train.x.dtype == torch.float32
    np.testing.assert_allclose(ds.train.x.numpy(), x.astype(np.float32))
    assert input_shape(npz_request(tmp_path / "t.npz")) == (12,)
    with pytest.raises(DataFormatError, match="per image channel"):
        load_data(npz_request(tmp_path / "t.npz", mean=(0.0,), std=(1.0,)))


def test_npz_class_count_is_the_largest_label_plus_one(tmp_path: Path) -> None:
    x = RNG.normal(size=(20, 3)).astype(np.float32)
    write_splits(tmp_path / "s.npz", x, np.where(np.arange(20) % 2, 5, 0))
    assert load_data(npz_request(tmp_path / "s.npz")).info.num_classes == 6


def test_npz_with_only_x_and_y_holds_out_a_seeded_test_fraction(tmp_path: Path) -> None:
    x = np.arange(100, dtype=np.float32).reshape(100, 1)
    np.savez(tmp_path / "xy.npz", x=x, y=np.arange(100) % 2)
    a = load_data(npz_request(tmp_path / "xy.npz", test_fraction=0.25, seed=3))
    b = load_data(npz_request(tmp_path / "xy.npz", test_fraction=0.25, seed=3))
    c = load_data(npz_request(tmp_path / "xy.npz", test_fraction=0.25, seed=4))
    train, test = set(a.train.x[:, 0].tolist()), set(a.test.x[:, 0].tolist())
    assert len(test) == 25 and len(train) == 75 and not train & test
    assert train | test == set(range(100))
    assert torch.equal(a.test.x, b.test.x) and not torch.equal(a.test.x, c.test.x)


def test_npz_in_two_files(tmp_path: Path) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((8, 4), np.float32), y=np.arange(8) % 2)
    np.savez(tmp_path / "test.npz", x_test=np.ones((3, 4), np.float32), y_test=np.array([0, 1, 1]))
    request = DataRequest(dataset="npz", dir=str(tmp_path), path="train.npz", test_path="test.npz")
    ds = load_data(request)
    assert (len(ds.train), len(ds.test)) == (8, 3)
    assert ds.test.x.sum() == 12 and ds.root == tmp_path / "train.npz"


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"images": np.zeros((4, 2)), "labels": np.zeros(4, int)}, r"expected arrays x and y"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4)}, r"integer labels"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3, int)}, r"3 labels for 4 samples"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, -1, 1, 0])}, r"labels must be >= 0"),
        ({"x": np.full((4, 2), np.nan), "y": np.array([0, 1, 1, 0])}, r"NaN"),
        ({"x": np.zeros((4, 2, 2, 2, 2)), "y": np.array([0, 1, 1, 0])}, r"expected images"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4, int)}, r"two classes"),
    ],
)
def test_npz_refusals_say_what_is_wrong(
    tmp_path: Path, arrays: dict[str, np.ndarray], fragment: str
) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)  # type: ignore[arg-type]
    with pytest.raises(DataFormatError, match=fragment):
        load_data(npz_request(tmp_path / "bad.npz", test_fraction=0.5))


def test_npz_refuses_object_arrays(tmp_path: Path) -> None:
    np.savez(tmp_path / "o.npz", x=np.array([{}, {}], dtype=object), y=np.array([0, 1]))
    with pytest.raises(DataFormatError, match=r"cannot read \.npz"):
        load_data(npz_request(tmp_path / "o.npz"))


def test_a_missing_or_unset_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match=r"reads \[data\] path \(an \.npz file\)"):
        load_data(DataRequest(dataset="npz"))
    with pytest.raises(DatasetNotFoundError, match=r"relative to data.dir .*each client"):
        load_data(DataRequest(dataset="npz", dir=str(tmp_path), path="nope.npz"))


def test_an_unknown_dataset_lists_the_known_kinds() -> None:
    with pytest.raises(UnknownDatasetError, match=r"cifar10.*npz, image_folder"):
        load_data(DataRequest(dataset="cifar100"))


# --- image folders ------------------------------------------------------------------------------


def write_images(
    root: Path, counts: dict[str, int], size: tuple[int, int] = (6, 4), mode: str = "RGB"
) -> None:
    """`counts[name]` random PNGs of `size` (width, height) in `root/name/`."""
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            shape = (size[1], size[0], len(mode)) if len(mode) > 1 else (size[1], size[0])
            pixels = RNG.integers(0, 256, size=shape, dtype=np.uint8)
            Image.fromarray(pixels, mode=mode).save(root / name / f"{i:03d}.png")


def test_image_folder_with_train_and_test(tmp_path: Path) -> None:
    write_images(tmp_path / "train", {"cat": 5, "ant": 4, "dog": 3})
    write_images(tmp_path / "test", {"cat": 2, "dog": 1})
    request = DataRequest(dataset="image_folder", path=str(tmp_path), normalize=False)
    ds = load_data(request)
    assert ds.info.class_names == ("ant", "cat", "dog")
    assert ds.info.input_shape == (3, 4, 6) == input_shape(request)
    assert ds.train.y.tolist() == [0] * 4 + [1] * 5 + [2] * 3
    assert ds.test.y.tolist() == [1, 1, 2]
    with Image.open(tmp_path / "train" / "ant" / "001.png") as picture:
        expected = np.asarray(picture).transpose(2, 0, 1) / 255.0
    np.testing.assert_allclose(ds.train.x[1].numpy(), expected, atol=1e-7)


def test_image_folder_grayscale_rgba_and_hold_out(tmp_path: Path) -> None:
    write_images(tmp_path, {"a": 10, "b": 10}, mode="L")
    gray = load_data(DataRequest(dataset="image_folder", path=str(tmp_path), test_fraction=0.25))
    assert gray.info.input_shape == (1, 4, 6)
    assert (len(gray.train), len(gray.test)) == (15, 5)
    write_images(tmp_path, {"c": 2}, mode="RGBA")
    mixed = load_data(DataRequest(dataset="image_folder", path=str(tmp_path)))
    assert mixed.info.input_shape == (3, 4, 6) and mixed.info.num_classes == 3


def test_image_folder_refuses_mixed_sizes_naming_the_file_unless_resized(tmp_path: Path) -> None:
    write_images(tmp_path / "train", {"a": 2, "b": 1})
    Image.new("RGB", (9, 9)).save(tmp_path / "train" / "b" / "odd.png")
    request = DataRequest(dataset="image_folder", path=str(tmp_path), test_fraction=0.3)
    with pytest.raises(
        DataFormatError,
        match=r"odd\.png: image is 9x9 but .*000\.png is 6x4.*"
        r"image_size",
    ):
        load_data(request)
    resized = load_data(
        DataRequest(dataset="image_folder", path=str(tmp_path), image_size=5, test_fraction=0.3)
    )
    assert resized.info.input_shape == (3, 5, 5)


def test_image_folder_layout_errors(tmp_path: Path) -> None:
    write_images(tmp_path / "train", {"only": 2})
    with pytest.raises(DataFormatError, match="1 class folder"):
        load_data(DataRequest(dataset="image_folder", path=str(tmp_path)))
    write_images(tmp_path / "train", {"other": 2})
    write_images(tmp_path / "test", {"stranger": 1})
    with pytest.raises(DataFormatError, match="test class 'stranger' has no training folder"):
        load_data(DataRequest(dataset="image_folder", path=str(tmp_path)))
    (tmp_path / "train" / "empty").mkdir()
    with pytest.raises(DataFormatError, match=r"no .* images in this class folder"):
        load_data(DataRequest(dataset="image_folder", path=str(tmp_path)))
    (tmp_path / "train" / "empty" / "x.png").write_bytes(b"not a png")
    (tmp_path / "test" / "stranger").rename(tmp_path / "test" / "other")
    with pytest.raises(DataFormatError, match=r"x\.png: cannot read image"):
        load_data(DataRequest(dataset="image_folder", path=str(tmp_path)))


# --- the rest of SplitMQ on generic data ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards", "label_ratio"])
def test_partitioners_work_on_generic_labels(tmp_path: Path, kind: PartitionKind) -> None:
    write_images(tmp_path, {"a": 40, "b": 30, "c": 30}, size=(3, 3))
    ds = load_data(DataRequest(dataset="image_folder", path=str(tmp_path), test_fraction=0.2))
    labels = ds.train.y.numpy()
    parts = partition(labels, kind, 4, seed=1, alpha=0.5, min_size=2, shard_size=10, ratio=0.5)
    assert len(parts) == 4 and all(len(p) for p in parts)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "no sample in two clients"
    if kind in ("iid", "dirichlet", "label_ratio"):
        assert len(joined) == len(labels)


def test_the_model_gets_the_input_shape_and_the_class_count_is_checked(tmp_path: Path) -> None:
    write_images(tmp_path, {"a": 6, "b": 6, "c": 6}, size=(28, 28))
    data = {"dataset": "image_folder", "path": str(tmp_path), "test_fraction": 0.3}
    wrong = Settings.model_validate({"data": data, "model": {"name": "lenet5"}})
    with pytest.raises(DataFormatError, match=r"3 classes but model.num_classes is 10.*= 3"):
        load_job_dataset(wrong)
    settings = Settings.model_validate(
        {"data": data, "model": {"name": "cnn5", "num_classes": 3, "cut": "block1"}}
    )
    ds = load_job_dataset(settings)
    assert job_input_shape(settings) == (3, 28, 28)
    model = job_model(settings)
    assert model(ds.test.x).shape == (len(ds.test), 3)
    declared = Settings.model_validate(
        {"data": {**data, "input_shape": [3, 9, 9]}, "model": {"num_classes": 3}}
    )
    assert job_input_shape(declared) == (3, 9, 9), "declared: the data is not read"
    with pytest.raises(DataFormatError, match=r"samples are \[3, 28, 28\] but data.input_shape"):
        check_fits(declared, ds.info)


def test_a_built_in_cnn_on_non_square_or_vector_data_says_what_to_do(tmp_path: Path) -> None:
    write_splits(tmp_path / "t.npz", RNG.normal(size=(20, 6)), np.arange(20) % 2)
    settings = Settings.model_validate(
        {"data": {"dataset": "npz", "path": str(tmp_path / "t.npz")}, "model": {"num_classes": 2}}
    )
    with pytest.raises(ModelSpecError, match=r"takes square images .* \[6\].*package.module"):
        job_model(settings)


def test_doctor_reports_a_generic_dataset_and_what_is_wrong_with_it(tmp_path: Path) -> None:
    write_splits(tmp_path / "d.npz", RNG.normal(size=(20, 6)), np.arange(20) % 2)

    def check(data: dict[str, object]) -> Check:
        return check_data(Settings.model_validate({"data": data}), {})

    found = check({"dataset": "npz", "dir": str(tmp_path), "path": "d.npz"})
    assert found.ok and found.detail == f"npz from {tmp_path / 'd.npz'}: samples [6]"
    missing = check({"dataset": "npz", "path": str(tmp_path / "gone.npz")})
    assert not missing.ok and "gone.npz" in missing.detail
    assert "data.md" in missing.hint
    builtin = check({"dataset": "mnist", "dir": str(tmp_path)})
    assert not builtin.ok and "SPLITMQ_DATA_DIR" in builtin.hint


def test_a_plugin_loader_is_used_and_its_arrays_checked() -> None:
    good = LabelledArrays(
        np.zeros((6, 4, 4), np.uint8), np.arange(6) % 2, np.zeros((2, 4, 4), np.uint8),
        np.array([0, 1]), class_names=("no", "yes"), augment=Augmentation(horizontal_flip=True),
    )  # fmt: skip
    bad = replace(good, y_test=np.array([0.0, 1.0]))
    plugins = FixedPlugins({"good": lambda _: good, "bad": lambda _: bad})
    ds = load_data(DataRequest(dataset="good"), plugins=plugins)
    assert ds.info.class_names == ("no", "yes") and ds.info.augment.horizontal_flip
    assert input_shape(DataRequest(dataset="good"), plugins=plugins) == (1, 4, 4)
    with pytest.raises(DataFormatError, match=r"\(test split\): expected integer labels"):
        load_data(DataRequest(dataset="bad"), plugins=plugins)


class FixedPlugins:
    """`Plugins` with what a test gives instead of installed entry points."""

    def __init__(self, loaders: dict[str, Loader]) -> None:
        self._loaders = loaders

    def names(self) -> list[str]:
        return sorted(self._loaders)

    def get(self, name: str) -> Loader | None:
        return self._loaders.get(name)
