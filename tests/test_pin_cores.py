"""train.py --pin-cores: which cores each local CPU rank is pinned to (runtime/launch.py ``core_share``).

The launch itself (a 2-rank run's ranks on disjoint cores, read from its metrics' ``cpu_affinity``) is checked
in tests/test_cost_model.py ``test_metrics_without_the_memory_meter``, which already launches 2 ranks."""

from __future__ import annotations

import pytest

from pdcompile.runtime.launch import core_share, parse_args
from pdcompile.runtime.program import Program


@pytest.mark.parametrize("rank, world, cores, share", [
    (0, 2, [0, 1], [0]), (1, 2, [1, 0], [1]),  # a core each, in the cores' order whatever order they came in
    (0, 2, [4, 5, 6, 7], [4, 5]), (1, 2, [4, 5, 6, 7], [6, 7]),  # an equal, contiguous share of the allowed ones
    (0, 3, list(range(8)), [0, 1]), (1, 3, list(range(8)), [2, 3, 4]), (2, 3, list(range(8)), [5, 6, 7]),
    (0, 3, [0, 1], None), (2, 3, [0, 1], None),  # more ranks than cores: not pinned (the kernel shares them out)
    (0, 1, [0, 1], None),  # one rank: nothing to keep apart
    (2, 2, [0, 1], None),  # a local rank outside the local world: not pinned
])
def test_core_share(rank: int, world: int, cores: list[int], share: list[int] | None) -> None:
    assert core_share(rank, world, cores) == share


def test_every_core_goes_to_exactly_one_rank() -> None:
    """On c >= n cores, the n shares cover the cores once each, and no two shares differ by more than one core."""
    for c in range(1, 10):
        for n in range(2, c + 1):
            shares = [core_share(r, n, list(range(c))) for r in range(n)]
            assert all(s for s in shares)
            assert sorted(x for s in shares for x in s) == list(range(c)), (c, n)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1  # type: ignore[arg-type]


def test_the_flag(tmp_path: object) -> None:
    """``--pin-cores`` is on by default and ``off`` opts out; anything else is refused by train.py's parser."""
    from pathlib import Path

    import torch

    from pdcompile.api import pdcompile

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    pipe = pdcompile(model, example_inputs=(torch.randn(4, 4),), example_target=torch.randint(0, 2, (4,)),
                     loss_fn=torch.nn.CrossEntropyLoss(), stages=2, num_microbatches=2)
    program = Program.load(pipe.emit(Path(str(tmp_path)) / "program"))
    assert parse_args(["--steps", "1"], program).pin_cores == "auto"
    assert parse_args(["--steps", "1", "--pin-cores", "off"], program).pin_cores == "off"
    with pytest.raises(SystemExit):
        parse_args(["--steps", "1", "--pin-cores", "all"], program)
