"""IDX and .npz readers, the dataset registry, data-directory resolution and load_dataset."""

from __future__ import annotations

import gzip
import io
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from services.data.errors import DataFormatError, DatasetNotFoundError, UnknownDatasetError
from services.data.files import parse_idx, read_idx, read_idx_pair, read_npz
from services.data.loaders import load_dataset, load_split_arrays, resolve_data_dir, to_tensor
from services.data.registry import DATASETS, SAMPLE_DIR, get_spec

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def random_gray(rng: np.random.Generator, n: int, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(0, 256, size=(n, size, size), dtype=np.uint8)
    y = rng.integers(0, 10, size=n).astype(np.uint8)
    return x, y


def write_mnist_npz(
    root: Path, rng: np.random.Generator, n_train: int = 50, n_test: int = 20
) -> None:
    for split, n in (("train", n_train), ("test", n_test)):
        x, y = random_gray(rng, n)
        np.savez_compressed(root / f"mnist_{split}.npz", x=x, y=y)


# --- IDX -------------------------------------------------------------------------------------


def test_parse_idx_uint8_images_roundtrip() -> None:
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    out = parse_idx(idx_bytes(x))
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, x)
    assert out.flags.writeable


def test_parse_idx_decodes_big_endian_int32() -> None:
    values = np.array([1, -2, 70000], dtype=">i4")
    out = parse_idx(idx_bytes(values, code=0x0C))
    assert out.dtype == np.dtype(np.int32)
    assert out.dtype.isnative
    assert out.tolist() == [1, -2, 70000]


@pytest.mark.parametrize(
    ("blob", "fragment"),
    [
        (b"\x00\x00", "too short"),
        (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "magic"),
        (b"\x00\x00\x07\x01" + struct.pack(">I", 1) + b"\x00", "type code 0x07"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x03" + struct.pack(">I", 5), "truncated IDX header"),
        (b"\x00\x00\x08\x02" + struct.pack(">II", 2, 3) + b"\x00" * 5, "(2, 3)"),
        (b"\x00\x00\x08\x01" + struct.pack(">I", 2) + b"\x00" * 3, "holds 3 data bytes"),
    ],
)
def test_parse_idx_rejects_bad_headers(blob: bytes, fragment: str) -> None:
    with pytest.raises(DataFormatError, match=r"bad\.idx") as info:
        parse_idx(blob, "bad.idx")
    assert fragment in info.value.reason


def test_read_idx_gzip_detected_by_content(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    path = tmp_path / "no-gz-suffix-idx3-ubyte"
    path.write_bytes(gzip.compress(idx_bytes(x)))
    np.testing.assert_array_equal(read_idx(path), x)


def test_read_idx_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "broken.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros((4, 2, 2), np.uint8)))[:-6])
    with pytest.raises(DataFormatError, match="gzip"):
        read_idx(path)


def test_read_idx_pair_checks_counts_and_rank(tmp_path: Path) -> None:
    images, labels = tmp_path / "i", tmp_path / "l"
    images.write_bytes(idx_bytes(np.zeros((4, 2, 2), np.uint8)))
    labels.write_bytes(idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(DataFormatError, match="3 labels for 4 images"):
        read_idx_pair(images, labels)
    labels.write_bytes(idx_bytes(np.zeros((4, 1), np.uint8)))
    with pytest.raises(DataFormatError, match="expected uint8 labels"):
        read_idx_pair(images, labels)


# --- npz -------------------------------------------------------------------------------------


def test_read_npz_custom_keys(tmp_path: Path) -> None:
    x, y = random_gray(np.random.default_rng(0), 5)
    np.savez_compressed(tmp_path / "a.npz", images=x, labels=y)
    got_x, got_y = read_npz(tmp_path / "a.npz", "images", "labels")
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)


def test_read_npz_missing_key_lists_contents(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=np.zeros((2, 4, 4), np.uint8), labels=np.zeros(2, np.uint8))
    with pytest.raises(DataFormatError, match=r"missing array\(s\) \['y'\].*'labels', 'x'"):
        read_npz(tmp_path / "a.npz")


def test_read_npz_refuses_object_arrays(tmp_path: Path) -> None:
    labels = np.empty(2, dtype=object)
    labels[:] = [1, 2]
    np.savez(tmp_path / "a.npz", x=np.zeros((2, 4, 4), np.uint8), y=labels)
    with pytest.raises(DataFormatError, match="allow_pickle"):
        read_npz(tmp_path / "a.npz")


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p.write_bytes(b"PK\x03\x04 definitely not a zip"), "cannot read .npz"),
        (lambda p: p.write_bytes(b"plain garbage"), "cannot read .npz"),
        (lambda p: p.write_bytes(npy_bytes(np.zeros(3))), "not an .npz archive"),
        (
            lambda p: np.savez(p, x=np.zeros((2, 4, 4), np.float32), y=np.zeros(2, np.uint8)),
            "expected uint8 images",
        ),
        (
            lambda p: np.savez(p, x=np.zeros((2, 4, 4), np.uint8), y=np.zeros(3, np.uint8)),
            "3 labels for 2 images",
        ),
    ],
)
def test_read_npz_bad_files(tmp_path: Path, make: Callable[[Path], object], fragment: str) -> None:
    path = tmp_path / "bad.npz"
    make(path)
    with pytest.raises(DataFormatError) as info:
        read_npz(path)
    assert fragment in str(info.value)
    assert str(path) in str(info.value)


# --- registry and resolution -----------------------------------------------------------------


def test_registry_contents() -> None:
    assert set(DATASETS) == {"mnist", "fashion_mnist", "cifar10", "fashion_mnist_sample"}
    cifar = get_spec("cifar10")
    assert cifar.train.npz == tuple(f"cifar10_train_part{k}.npz" for k in range(1, 6))
    assert (cifar.channels, cifar.height, len(cifar.mean), cifar.num_classes) == (3, 32, 3, 10)
    assert get_spec("fashion_mnist_sample").bundled
    assert not any(DATASETS[n].bundled for n in ("mnist", "fashion_mnist", "cifar10"))
    with pytest.raises(TypeError):
        DATASETS["x"] = cifar  # type: ignore[index]


def test_unknown_dataset_lists_names() -> None:
    with pytest.raises(UnknownDatasetError, match="cifar10, fashion_mnist, fashion_mnist_sample"):
        load_dataset("imagenet", "/nonexistent")


def test_missing_files_error_lists_expectations(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("mnist", tmp_path, env={})
    message = str(info.value)
    for expected in (str(tmp_path), "mnist_train.npz", "mnist_test.npz", "train-images-idx3-ubyte"):
        assert expected in message
    with pytest.raises(DatasetNotFoundError, match=r"cifar10_train_part5\.npz"):
        load_dataset("cifar10", tmp_path, env={})


def test_no_directory_at_all_says_how_to_set_one() -> None:
    with pytest.raises(DatasetNotFoundError, match="set SPLITMQ_DATA_DIR"):
        resolve_data_dir(get_spec("mnist"), None, env={})


def test_resolution_order(tmp_path: Path) -> None:
    spec = get_spec("fashion_mnist_sample")
    explicit, from_env = tmp_path / "explicit", tmp_path / "env"
    for d in (explicit, from_env):
        d.mkdir()
        (d / "fashion_mnist_sample.npz").write_bytes(b"")
    env = {"SPLITMQ_DATA_DIR": str(from_env)}
    assert resolve_data_dir(spec, explicit, env) == explicit
    assert resolve_data_dir(spec, None, env) == from_env
    assert resolve_data_dir(spec, None, {}) == SAMPLE_DIR
    # An env directory without the sample falls through to the shipped copy...
    assert resolve_data_dir(spec, None, {"SPLITMQ_DATA_DIR": str(tmp_path)}) == SAMPLE_DIR
    # ...but an explicit directory is the only place searched.
    with pytest.raises(DatasetNotFoundError, match="data_dir argument"):
        resolve_data_dir(spec, tmp_path, env)
    # The shipped fallback is for the bundled sample only.
    with pytest.raises(DatasetNotFoundError, match="SPLITMQ_DATA_DIR"):
        resolve_data_dir(get_spec("mnist"), None, env)


# --- load_dataset on synthetic files ---------------------------------------------------------


def test_load_dataset_from_npz_normalises_and_types(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    write_mnist_npz(tmp_path, rng)
    ds = load_dataset("mnist", tmp_path, env={})
    raw_x, raw_y = (
        np.load(tmp_path / "mnist_train.npz")["x"],
        np.load(tmp_path / "mnist_train.npz")["y"],
    )
    assert ds.root == tmp_path
    assert ds.train.x.shape == (50, 1, 28, 28) and ds.test.x.shape == (20, 1, 28, 28)
    assert ds.train.x.dtype == torch.float32 and ds.train.y.dtype == torch.int64
    assert ds.train.x.is_contiguous()
    expected = (raw_x.astype(np.float64) / 255.0 - MNIST_MEAN) / MNIST_STD
    np.testing.assert_allclose(ds.train.x[:, 0].numpy(), expected, atol=1e-5)
    assert ds.train.y.tolist() == raw_y.tolist()
    assert len(ds.train) == 50 and ds.info.num_classes == 10


def test_idx_and_npz_give_identical_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    npz_dir, idx_dir = tmp_path / "npz", tmp_path / "idx"
    npz_dir.mkdir()
    idx_dir.mkdir()
    names = {
        "train": ("train-images-idx3-ubyte.gz", "train-labels.idx1-ubyte"),  # both spellings
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte.gz"),
    }
    for split, (images, labels) in names.items():
        x, y = random_gray(rng, 30)
        np.savez_compressed(npz_dir / f"fashion_mnist_{split}.npz", x=x, y=y)
        for name, array in ((images, x), (labels, y)):
            blob = idx_bytes(array)
            (idx_dir / name).write_bytes(gzip.compress(blob) if name.endswith(".gz") else blob)
    a = load_dataset("fashion_mnist", npz_dir, env={})
    b = load_dataset("fashion_mnist", idx_dir, env={})
    for split in ("train", "test"):
        assert torch.equal(getattr(a, split).x, getattr(b, split).x)
        assert torch.equal(getattr(a, split).y, getattr(b, split).y)


def test_corrupt_idx_surfaces_through_load_dataset(tmp_path: Path) -> None:
    x, y = random_gray(np.random.default_rng(3), 10)
    bad = bytearray(idx_bytes(x))
    bad[7] += 1  # first dimension 10 -> 11: the data no longer fills the declared shape
    (tmp_path / "train-images-idx3-ubyte").write_bytes(bytes(bad))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(y))
    np.savez(tmp_path / "mnist_test.npz", x=x, y=y)
    with pytest.raises(DataFormatError, match=r"train-images-idx3-ubyte: IDX header declares"):
        load_dataset("mnist", tmp_path, env={})


def test_rejects_wrong_image_size_and_label_range(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    write_mnist_npz(tmp_path, rng)
    x, y = random_gray(rng, 8, size=32)
    np.savez(tmp_path / "mnist_train.npz", x=x, y=y)
    with pytest.raises(DataFormatError, match=r"needs H,W,C \(28, 28, 1\)"):
        load_dataset("mnist", tmp_path, env={})
    x, y = random_gray(rng, 8)
    y[0], y[3] = 0, 10
    np.savez(tmp_path / "mnist_train.npz", x=x, y=y)
    with pytest.raises(DataFormatError, match=r"labels span 0\.\.10"):
        load_dataset("mnist", tmp_path, env={})


def test_to_tensor_rgb_is_nchw_per_channel() -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, size=(5000, 4, 3, 3), dtype=np.uint8)  # > one block, HWC
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.3, 0.4)
    out = to_tensor(x, mean, std)
    assert out.shape == (5000, 3, 4, 3)
    for c in range(3):
        expected = (x[..., c] / 255.0 - mean[c]) / std[c]
        np.testing.assert_allclose(out[:, c].numpy(), expected, atol=1e-5)


def test_to_tensor_accepts_read_only_input() -> None:
    x = np.frombuffer(bytes(range(16)), dtype=np.uint8).reshape(1, 4, 4)
    out = to_tensor(x, (0.0,), (1.0,))
    np.testing.assert_allclose(out[0, 0].numpy(), x[0] / 255.0, atol=1e-7)


# --- the real shared datasets ----------------------------------------------------------------

README_COUNTS = {
    ("mnist", "train"): [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    ("mnist", "test"): [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
    ("fashion_mnist", "train"): [6000] * 10,
    ("fashion_mnist", "test"): [1000] * 10,
    ("cifar10", "train"): [5000] * 10,
    ("cifar10", "test"): [1000] * 10,
}
SHAPES = {"mnist": (28, 28), "fashion_mnist": (28, 28), "cifar10": (32, 32, 3)}


@pytest.mark.parametrize(("name", "split"), sorted(README_COUNTS))
def test_real_label_counts_and_shapes(data_dir: str, name: str, split: str) -> None:
    x, y = load_split_arrays(get_spec(name), split, data_dir)
    counts = README_COUNTS[(name, split)]
    assert x.shape == (sum(counts), *SHAPES[name])
    assert x.dtype == np.uint8 and y.dtype == np.int64
    assert np.bincount(y, minlength=10).tolist() == counts


def test_real_cifar_parts_concatenate_in_order(data_dir: str) -> None:
    _, y = load_split_arrays(get_spec("cifar10"), "train", data_dir)
    # README per-part counts: part 1 is data_batch_1, part 5 is data_batch_5.
    assert np.bincount(y[:10000]).tolist()[:3] == [1005, 974, 1032]
    assert np.bincount(y[40000:]).tolist()[:3] == [1014, 1014, 952]
    with np.load(Path(data_dir) / "cifar10_train_part3.npz") as part3:
        np.testing.assert_array_equal(y[20000:30000], part3["y"])


def test_real_fashion_mnist_is_standardised(data_dir: str) -> None:
    ds = load_dataset("fashion_mnist", data_dir, env={})
    assert ds.train.x.shape == (60000, 1, 28, 28) and ds.test.x.shape == (10000, 1, 28, 28)
    # The registry's constants are the train statistics, so the result is ~N(0, 1) per pixel.
    assert abs(float(ds.train.x.mean())) < 0.01
    assert abs(float(ds.train.x.std()) - 1.0) < 0.01


@pytest.mark.slow
def test_real_cifar10_load_dataset(data_dir: str) -> None:
    ds = load_dataset("cifar10", data_dir, env={})
    assert ds.train.x.shape == (50000, 3, 32, 32) and ds.test.x.shape == (10000, 3, 32, 32)
    per_channel_mean = ds.train.x.mean(dim=(0, 2, 3))
    per_channel_std = ds.train.x.std(dim=(0, 2, 3))
    assert torch.all(per_channel_mean.abs() < 0.01)
    # JPEG smoothing in our copy lowers the stds ~1% below the published constants.
    assert torch.all((per_channel_std - 1.0).abs() < 0.02)
    with np.load(Path(data_dir) / "cifar10_train_part1.npz") as part1:
        first = part1["x"][0]
    spec = get_spec("cifar10")
    for c in range(3):
        expected = (first[..., c] / 255.0 - spec.mean[c]) / spec.std[c]
        np.testing.assert_allclose(ds.train.x[0, c].numpy(), expected, atol=1e-5)
