"""runtime/data.py's Reader: a replica reading its share of a DataLoader (only its microbatches fetched) sees
exactly what reading every minibatch whole and keeping its share gives, over several epochs, also where a
step has fewer microbatches than the stage has replicas (PipeDream's 1F1B: one microbatch per minibatch,
replicas taking turns), which fetched an empty batch and failed before."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pdcompile.errors import UsageError
from pdcompile.runtime.data import Reader, positions

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("replicas,M", [(2, 1), (3, 2), (2, 4)])
def test_a_shared_loader_reads_what_reading_whole_keeps(replicas: int, M: int) -> None:
    b, per_epoch = 2, 5
    n = b * M * per_epoch
    data = TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n))
    loader = DataLoader(data, batch_size=b * M, shuffle=False, drop_last=True)
    whole_list = [(x, y) for x, y in loader]  # a list is read whole, its share kept
    took = []
    for rank in range(replicas):
        pos = positions([list(range(replicas))], rank, M)
        assert pos is not None
        shared = Reader(loader, b, M, pos, per_epoch)
        whole = Reader(whole_list, b, M, pos, per_epoch)
        assert shared.shared and not whole.shared
        took.append(0)
        for _ in range(3 * per_epoch):  # three epochs
            i, p, inputs, target = next(shared)
            j, q, inputs_w, target_w = next(whole)
            assert (i, p) == (j, q)
            if p:
                assert torch.equal(target, target_w) and target.numel() == b * len(p)
                assert len(inputs) == 1 and torch.equal(inputs[0], inputs_w[0])
                took[-1] += len(p)
            else:
                assert inputs == () and target.numel() == 0 == target_w.numel()
        assert shared.epoch == whole.epoch == 2
    assert sum(took) == 3 * per_epoch * M and max(took) - min(took) <= 1  # every microbatch once, in turns


def test_one_pass_runs_out_at_the_end_of_the_data_as_reading_whole_does() -> None:
    """``--steps`` (``one_pass``): past the data's full minibatches a shared reader says the data ran out, as
    a reader of the whole data does, rather than starting a second pass."""
    b, M, per_epoch = 2, 1, 4
    data = TensorDataset(torch.zeros(b * M * per_epoch, 1), torch.arange(b * M * per_epoch))
    loader = DataLoader(data, batch_size=b * M, shuffle=False, drop_last=True)
    pos = positions([[0, 1]], 1, M)
    for reader in (Reader(loader, b, M, pos, per_epoch, one_pass=True), Reader(loader, b, M, pos, None)):
        for _ in range(per_epoch):
            next(reader)
        with pytest.raises(UsageError, match="ran out after 4 minibatches"):
            next(reader)
