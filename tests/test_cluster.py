"""ClusterSpec: TOML and dict forms, units, ranks and bandwidths, errors that name key and line."""

from __future__ import annotations

import math

import pytest

from pdcompile.cluster import (
    ClusterSpec,
    Device,
    Level,
    format_quantity,
    local_cpu_cluster,
    paper_cluster,
    parse_quantity,
)
from pdcompile.errors import ClusterSpecError

ISSUE_TOML = """\
[device]
name = "V100"
memory = "16 GiB"        # per worker
peak_flops = "15.7 TFLOPS"   # optional; for analytic costs

[[levels]]
name = "gpus-in-server"
count = 4
bandwidth = "10 GB/s"

[[levels]]
name = "servers"
count = 4
bandwidth = "10 Gbit/s"
"""


def test_issue_example_from_text_and_file(tmp_path):
    c = ClusterSpec.from_toml(ISSUE_TOML)
    assert c.num_workers == 16
    assert c.device == Device("V100", memory=16 * 2**30, peak_flops=15.7e12)
    assert c.levels == (Level("gpus-in-server", 4, 10e9), Level("servers", 4, 10e9 / 8))
    p = tmp_path / "c.toml"
    p.write_text(ISSUE_TOML)
    assert ClusterSpec.from_toml(p) == c
    assert ClusterSpec.from_toml(str(p)) == c
    assert ClusterSpec.from_dict(c.to_dict()) == c
    assert ClusterSpec.from_toml(c.to_toml()) == c
    assert "16 workers" in str(c) and "10 GB/s" in str(c)


@pytest.mark.parametrize(
    "text,kind,value",
    [
        ("10 GB/s", "bandwidth", 1e10),
        ("10 Gbit/s", "bandwidth", 1.25e9),
        ("25 Gb/s", "bandwidth", 25e9 / 8),
        ("1 GiB/s", "bandwidth", 2**30),
        ("300GB/s", "bandwidth", 3e11),
        (5e9, "bandwidth", 5e9),
        ("16 GiB", "memory", 16 * 2**30),
        ("512 MB", "memory", 512e6),
        (1024, "memory", 1024.0),
        ("15.7 TFLOPS", "flops", 15.7e12),
        ("1e12", "flops", 1e12),
        ("2 PFLOPS", "flops", 2e15),
    ],
)
def test_parse_quantity(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


@pytest.mark.parametrize("text,kind", [("10 GB", "bandwidth"), ("16 GB/s", "memory"), ("3 parsecs", "memory"),
                                       ("fast", "bandwidth"), (True, "memory"), ("1 TFLOPS", "bandwidth")])
def test_parse_quantity_rejects(text, kind):
    with pytest.raises(ValueError):
        parse_quantity(text, kind)


def test_format_quantity():
    assert format_quantity(16 * 2**30, "memory") == "16 GiB"
    assert format_quantity(1e10, "bandwidth") == "10 GB/s"
    assert format_quantity(None, "memory") == "-"


def test_ranks_and_bandwidth_between():
    c = paper_cluster("A")  # 4 per server, 4 servers
    assert c.coordinates(0) == (0, 0) and c.coordinates(5) == (1, 1) and c.coordinates(15) == (3, 3)
    assert c.bandwidth_between(0, 3) == 10e9  # same server
    assert c.bandwidth_between(3, 4) == 10e9 / 8  # across servers
    assert c.bandwidth_between(2, 2) == math.inf
    assert c.shared_level(1, 2) == 0 and c.shared_level(1, 9) == 1
    assert c.unit_size(0) == 1 and c.unit_size(1) == 4 and c.unit_size(2) == 16
    with pytest.raises(ValueError):
        c.coordinates(16)


def test_slowest_bandwidth_is_the_least_over_every_pair():
    """The slowest link among a set of ranks (the simulator's all-reduce rate), read off neighbours in rank
    order, is the least ``bandwidth_between`` over every pair, on random hierarchies whose bandwidths need not
    fall outwards and random rank sets (with repeats)."""
    import random

    rng = random.Random(5)
    for _ in range(300):
        levels = tuple(Level(f"l{k}", rng.randint(1, 4), rng.choice([1e9, 5e9, 50e9, 300e9]))
                       for k in range(rng.randint(1, 4)))
        c = ClusterSpec(Device("gpu"), levels)
        ranks = [rng.randrange(c.num_workers) for _ in range(rng.randint(0, 8))]
        want = min((c.bandwidth_between(a, b) for a in ranks for b in ranks if a != b), default=math.inf)
        assert c.slowest_bandwidth(ranks) == want, (levels, ranks)


def test_paper_and_local_clusters():
    a, b = paper_cluster("A"), paper_cluster("b")
    assert a.counts == (4, 4) and a.bandwidths == (10e9, 1.25e9)
    assert b.counts == (8, 2) and b.bandwidths == (300e9, 25e9 / 8)
    assert a.device.memory == 16 * 2**30
    assert paper_cluster("B", servers=128).num_workers == 1024
    with pytest.raises(ClusterSpecError):
        paper_cluster("C")
    local = local_cpu_cluster(3)
    assert local.num_workers == 3 and local.levels[0].bandwidth == 2e9
    assert local.device.memory is None or local.device.memory > 0


BAD = [
    ('[device]\nmemory = "16 GiB"\n\n[[levels]]\ncount = 0\nbandwidth = "1 GB/s"\n', "levels[0].count", 5),
    ('[device]\nmemory = "16 GiB"\n\n[[levels]]\ncount = -2\nbandwidth = "1 GB/s"\n', "levels[0].count", 5),
    ('[device]\nmemory = "16 GiB"\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n\n[[levels]]\ncount = 2\n'
     'bandwidth = "-3 GB/s"\n', "levels[1].bandwidth", 10),
    ('[device]\nmemory = "16 GiB"\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB"\n', "levels[0].bandwidth", 6),
    ('[device]\nmemory = "16 GB/s"\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n', "device.memory", 2),
    ('[device]\nname = "x"\nmemory = 0\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n', "device.memory", 3),
    ('[device]\nmemroy = "16 GiB"\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n', "device.memroy", 2),
    ('[device]\nmemory = "16 GiB"\n\n[[levels]]\nbandwidth = "1 GB/s"\n', "levels[0]", 4),
    ('[device]\nmemory = "16 GiB"\n\n[[levels]]\ncount = 2.5\nbandwidth = "1 GB/s"\n', "levels[0].count", 5),
    ('[device]\nmemory = "16 GiB"\n', "levels", None),
    ('[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n', "device", None),
]


@pytest.mark.parametrize("text,key,line", BAD)
def test_invalid_specs_name_key_and_line(tmp_path, text, key, line):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ClusterSpecError) as e:
        ClusterSpec.from_toml(p)
    msg = str(e.value)
    assert key in msg
    if line is not None:
        assert f"bad.toml:{line}:" in msg


def test_invalid_python_construction():
    with pytest.raises(ClusterSpecError):
        Level("x", 0, 1.0)
    with pytest.raises(ClusterSpecError):
        Level("x", 2, 0.0)
    with pytest.raises(ClusterSpecError):
        Device("d", memory=-1.0)
    with pytest.raises(ClusterSpecError):
        ClusterSpec(Device("d"), ())
    with pytest.raises(ClusterSpecError):
        ClusterSpec.from_toml("[device\n")


def test_memory_limit_needs_memory():
    from pdcompile.cluster import require_memory

    with pytest.raises(ClusterSpecError, match="device.memory"):
        require_memory(ClusterSpec(Device("d"), (Level("l", 2, 1.0),)))
