"""ClusterSpec: the machine a plan is made for — a device and a hierarchy of levels.

A cluster is a device (per-worker memory, optional peak FLOP/s and memory bandwidth) and levels
of a hierarchy, innermost first, each with a ``count`` and the ``bandwidth`` of its links: e.g.
4 GPUs in a server at 10 GB/s, then 4 servers at 10 Gbit/s. The number of workers is the product
of the counts. Ranks are laid out innermost-first: rank ``r`` sits at position ``r % c0`` of its
server, server ``(r // c0) % c1``, and so on. The TOML form and its units are documented for
users in README.md ("Describing a cluster"; units: :func:`parse_quantity`); errors raise
:class:`~pdcompile.errors.ClusterSpecError` naming the key and, from a file, its line.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from pdcompile.errors import ClusterSpecError

__all__ = [
    "Level",
    "Device",
    "ClusterSpec",
    "parse_quantity",
    "format_quantity",
    "local_cpu_cluster",
    "paper_cluster",
]

_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}


def _unit_table() -> dict[str, dict[str, float]]:
    bandwidth: dict[str, float] = {}
    memory: dict[str, float] = {}
    flops: dict[str, float] = {}
    for p, f in _DEC.items():
        bandwidth[f"{p}B/s"] = f
        bandwidth[f"{p}bit/s"] = f / 8
        memory[f"{p}B"] = f
        for spelling in ("FLOPS", "FLOP/s", "flops", "FLOPs/s"):
            flops[f"{p}{spelling}"] = f
        if p:
            bandwidth[f"{p}b/s"] = f / 8
            bandwidth[f"{p}bps"] = f / 8
    for p, f in _BIN.items():
        bandwidth[f"{p}B/s"] = f
        memory[f"{p}B"] = f
    return {"bandwidth": bandwidth, "memory": memory, "flops": flops}


_UNITS = _unit_table()
_QUANTITY_RE = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*$")


def parse_quantity(value: Any, kind: str) -> float:
    """``"10 GB/s"`` -> 1e10 (kind ``"bandwidth"``), ``"16 GiB"`` -> 17179869184.0 (``"memory"``),
    ``"15.7 TFLOPS"`` -> 1.57e13 (``"flops"``). Plain numbers (or unit-less strings) are taken in
    the base unit (bytes/s, bytes, FLOP/s). Raises :class:`ValueError` on an unknown unit or a
    malformed value (callers add the key and line).

    Units: bandwidth ``B/s kB/s KB/s MB/s GB/s TB/s KiB/s MiB/s GiB/s TiB/s bit/s kbit/s Mbit/s
    Gbit/s Tbit/s`` (``Gb/s`` and ``Gbps`` read as Gbit/s); memory ``B kB KB MB GB TB KiB MiB GiB
    TiB``; FLOP/s ``FLOPS kFLOPS MFLOPS GFLOPS TFLOPS PFLOPS`` (``FLOP/s`` spellings too). Decimal
    prefixes are powers of 1000, binary ones (``Ki``, ``Mi``...) powers of 1024."""
    if kind not in _UNITS:
        raise ValueError(f"unknown quantity kind {kind!r} (use bandwidth, memory or flops)")
    if isinstance(value, bool):
        raise ValueError(f"expected a number or a string with a unit, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a number or a string with a unit, got {value!r}")
    m = _QUANTITY_RE.match(value)
    if not m:
        raise ValueError(f"cannot read {value!r} as a {kind} (e.g. {_EXAMPLE[kind]!r})")
    number, unit = float(m.group(1)), m.group(2)
    if not unit:
        return number
    table = _UNITS[kind]
    if unit not in table:
        known = ", ".join(_KNOWN[kind])
        raise ValueError(f"unknown {kind} unit {unit!r} in {value!r} (use one of: {known})")
    return number * table[unit]


_EXAMPLE = {"bandwidth": "10 GB/s", "memory": "16 GiB", "flops": "15.7 TFLOPS"}
_KNOWN = {
    "bandwidth": ["B/s", "MB/s", "GB/s", "GiB/s", "Mbit/s", "Gbit/s", "Gb/s"],
    "memory": ["B", "MB", "GB", "MiB", "GiB", "TiB"],
    "flops": ["GFLOPS", "TFLOPS", "PFLOPS"],
}


def format_quantity(value: float | None, kind: str) -> str:
    """A short human form: ``1e10`` bandwidth -> ``"10 GB/s"``, memory in GiB/MiB."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    if kind == "memory":
        for unit, f in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
            if abs(value) >= f:
                return f"{value / f:.4g} {unit}"
        return f"{value:.4g} B"
    suffix = {"bandwidth": "B/s", "flops": "FLOPS"}[kind]
    for prefix, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= f:
            return f"{value / f:.4g} {prefix}{suffix}"
    return f"{value:.4g} {suffix}"


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``count`` units of the level below, linked at ``bandwidth``
    bytes/s (per direction, per link)."""

    name: str
    count: int
    bandwidth: float

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count <= 0:
            raise ClusterSpecError(f"level {self.name!r}: count must be a positive integer (got {self.count!r})")
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0 and not math.isnan(self.bandwidth)):
            raise ClusterSpecError(f"level {self.name!r}: bandwidth must be positive (got {self.bandwidth!r})")

    def __str__(self) -> str:
        return f"{self.count} x {self.name} @ {format_quantity(self.bandwidth, 'bandwidth')}"


@dataclass(frozen=True)
class Device:
    """A worker: ``memory`` in bytes (None: unknown), ``peak_flops`` in FLOP/s (None: unknown),
    ``memory_bandwidth`` in bytes/s (None: unknown; the default cost model then leaves the
    optimizer step's time out), ``peak_flops_bf16``: the bf16 peak (None: unknown; analytic costs
    under ``precision="bf16"`` then use ``peak_flops``)."""

    name: str
    memory: float | None = None
    peak_flops: float | None = None
    memory_bandwidth: float | None = None
    peak_flops_bf16: float | None = None
    cores: int | None = None  # the host's cores the workers share (a local CPU cluster), None: their own

    def __post_init__(self) -> None:
        for key in ("memory", "peak_flops", "memory_bandwidth", "peak_flops_bf16", "cores"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ClusterSpecError(f"device.{key} must be positive (got {v!r})")

    def __str__(self) -> str:
        parts = [self.name]
        if self.memory is not None:
            parts.append(format_quantity(self.memory, "memory"))
        if self.peak_flops is not None:
            parts.append(format_quantity(self.peak_flops, "flops"))
        if self.memory_bandwidth is not None:
            parts.append("mem " + format_quantity(self.memory_bandwidth, "bandwidth"))
        return ", ".join(parts)


@dataclass(frozen=True)
class ClusterSpec:
    """A device and the levels of the hierarchy, innermost first."""

    device: Device
    levels: tuple[Level, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.levels, tuple):
            object.__setattr__(self, "levels", tuple(self.levels))
        if not self.levels:
            raise ClusterSpecError("levels: a cluster needs at least one level")

    @property
    def num_workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(level.count for level in self.levels)

    @property
    def bandwidths(self) -> tuple[float, ...]:
        return tuple(level.bandwidth for level in self.levels)

    def unit_size(self, level: int) -> int:
        """Workers in one unit of ``level`` (0-based; the innermost level's units are workers,
        so ``unit_size(0) == 1`` and ``unit_size(len(levels)) == num_workers``)."""
        return math.prod(level_.count for level_ in self.levels[:level])

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """``rank``'s index at every level, innermost first."""
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} outside 0..{self.num_workers - 1}")
        out = []
        for level in self.levels:
            out.append(rank % level.count)
            rank //= level.count
        return tuple(out)

    def shared_level(self, rank_a: int, rank_b: int) -> int:
        """The innermost level (0-based) that contains both ranks; -1 when they are equal."""
        ca, cb = self.coordinates(rank_a), self.coordinates(rank_b)
        for k in range(len(self.levels) - 1, -1, -1):
            if ca[k] != cb[k]:
                return k
        return -1

    def bandwidth_between(self, rank_a: int, rank_b: int) -> float:
        """Bandwidth of the innermost level the two ranks share (``inf`` for the same rank)."""
        k = self.shared_level(rank_a, rank_b)
        return math.inf if k < 0 else self.levels[k].bandwidth

    def slowest_bandwidth(self, ranks: Iterable[int]) -> float:
        """The slowest link among ``ranks``: the least :meth:`bandwidth_between` over every pair of distinct
        ones (``inf`` for fewer than two). Ranks count innermost first, so each unit of a level is a run of
        consecutive ranks and the outermost level two of them span is spanned by two neighbours in rank
        order: the neighbours' links are every pair's, in O(n log n) rather than O(n^2)."""
        rs = sorted(set(ranks))
        return min((self.bandwidth_between(a, b) for a, b in zip(rs, rs[1:])), default=math.inf)

    # -- construction -------------------------------------------------------------------
    @staticmethod
    def from_dict(d: Mapping[str, Any], *, where: str = "<dict>", text: str | None = None) -> "ClusterSpec":
        """Build from the TOML layout as a dict (``device`` table, ``levels`` list of tables)."""
        return _from_dict(d, where, text)

    @staticmethod
    def from_toml(path_or_text: str | os.PathLike[str]) -> "ClusterSpec":
        """Read a TOML cluster description from a file path, or from TOML text."""
        text, where = _read_source(path_or_text)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ClusterSpecError(f"{where}: invalid TOML ({e})") from None
        return _from_dict(data, where, text)

    def to_dict(self) -> dict[str, Any]:
        device: dict[str, Any] = {"name": self.device.name}
        for key in ("memory", "peak_flops", "memory_bandwidth", "peak_flops_bf16", "cores"):
            v = getattr(self.device, key)
            if v is not None:
                device[key] = v
        return {
            "device": device,
            "levels": [{"name": l.name, "count": l.count, "bandwidth": l.bandwidth} for l in self.levels],
        }

    def to_toml(self) -> str:
        """The TOML form (quantities in base units), readable by :meth:`from_toml`."""
        d = self.to_dict()
        lines = ["[device]"]
        for key, v in d["device"].items():
            lines.append(f"{key} = {v!r}" if not isinstance(v, str) else f'{key} = "{v}"')
        for level in d["levels"]:
            lines += ["", "[[levels]]", f'name = "{level["name"]}"', f"count = {level['count']}",
                      f"bandwidth = {level['bandwidth']!r}"]
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        levels = ", ".join(str(level) for level in self.levels)
        return f"{self.num_workers} workers ({self.device}): {levels}"

    def first_workers(self, workers: int) -> "ClusterSpec | None":
        """The cluster of this one's first ``workers`` ranks, with its levels (a group of whole units of
        one level, or part of an innermost unit): what one of ``num_workers / workers`` copies of a
        pipeline runs on. None where they are not such a group (12 of 8 x 8)."""
        if not 0 < workers <= self.num_workers:
            return None
        if workers <= self.levels[0].count:
            return ClusterSpec(self.device, (Level(self.levels[0].name, workers, self.levels[0].bandwidth),))
        for k in range(1, len(self.levels)):
            size = self.unit_size(k)
            if size < workers <= size * self.levels[k].count:
                if workers % size:
                    return None
                top = self.levels[k]
                return ClusterSpec(self.device, (*self.levels[:k], Level(top.name, workers // size, top.bandwidth)))
        return None

    def with_workers(self, workers: int) -> "ClusterSpec":
        """This cluster with at least ``workers`` workers: its outermost level's count multiplied as
        needed (same device and links). Where a plan costs each of more stages than workers on a
        worker of its own (virtual stages), it does so on the user's device and links."""
        if workers <= self.num_workers:
            return self
        top = self.levels[-1]
        times = -(-workers // self.num_workers)
        return ClusterSpec(self.device, (*self.levels[:-1], Level(top.name, top.count * times, top.bandwidth)))

    def with_memory(self, memory: float | None) -> "ClusterSpec":
        return ClusterSpec(
            Device(self.device.name, memory, self.device.peak_flops, self.device.memory_bandwidth,
                   self.device.peak_flops_bf16, self.device.cores),
            self.levels,
        )


def _read_source(path_or_text: str | os.PathLike[str]) -> tuple[str, str]:
    p = Path(path_or_text)
    if not isinstance(path_or_text, os.PathLike) and ("\n" in path_or_text or "=" in path_or_text):
        try:
            is_file = p.is_file()
        except OSError:  # e.g. a name too long to be a path
            is_file = False
        if not is_file:
            return path_or_text, "<toml>"  # TOML text, not a file name
    try:
        return p.read_text(), str(p)
    except OSError as e:
        raise ClusterSpecError(f"{p}: cannot read cluster file ({e.strerror})") from None


def _line_of(text: str | None, table: str, index: int | None, key: str | None) -> int | None:
    """1-based line of ``key`` inside ``[table]`` (or the ``index``-th ``[[table]]``), or of the
    table header when ``key`` is None or absent there. Best effort; None when not found."""
    if text is None:
        return None
    lines = text.splitlines()
    header = re.compile(rf"^\s*\[\[\s*{re.escape(table)}\s*\]\]" if index is not None
                        else rf"^\s*\[\s*{re.escape(table)}\s*\]")
    any_header = re.compile(r"^\s*\[")
    seen = -1
    start = None
    for n, line in enumerate(lines):
        if header.match(line):
            seen += 1
            if index is None or seen == index:
                start = n
                break
    if start is None:
        # a top-level key (e.g. "levels = [...]" inline) or a dotted key
        if key is not None:
            pat = re.compile(rf"^\s*{re.escape(table)}\s*=")
            for n, line in enumerate(lines):
                if pat.match(line):
                    return n + 1
        return None
    if key is None:
        return start + 1
    pat = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for n in range(start + 1, len(lines)):
        if any_header.match(lines[n]):
            break
        if pat.match(lines[n]):
            return n + 1
    return start + 1


def _err(where: str, text: str | None, table: str, index: int | None, key: str | None, msg: str) -> ClusterSpecError:
    line = _line_of(text, table, index, key)
    loc = f"{where}:{line}" if line is not None else where
    name = table if index is None else f"{table}[{index}]"
    if key is not None:
        name += f".{key}"
    return ClusterSpecError(f"{loc}: {name}: {msg}")


def _from_dict(d: Mapping[str, Any], where: str, text: str | None) -> ClusterSpec:
    if not isinstance(d, Mapping):
        raise ClusterSpecError(f"{where}: a cluster description is a table with [device] and [[levels]]")
    unknown = set(d) - {"device", "levels", "name"}
    if unknown:
        key = sorted(unknown)[0]
        raise _err(where, text, key, None, None, "unknown key (expected [device] and [[levels]])")
    dev = d.get("device")
    if not isinstance(dev, Mapping):
        raise ClusterSpecError(f"{where}: device: missing [device] table (name, memory, ...)")
    dev_unknown = set(dev) - {"name", "memory", "peak_flops", "memory_bandwidth", "peak_flops_bf16", "cores"}
    if dev_unknown:
        key = sorted(dev_unknown)[0]
        raise _err(where, text, "device", None, key,
                   "unknown key (use name, memory, peak_flops, memory_bandwidth, peak_flops_bf16, cores)")
    cores = dev.get("cores")
    if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores <= 0):
        raise _err(where, text, "device", None, "cores", f"must be a positive whole number (got {cores!r})")

    def quantity(table: str, index: int | None, key: str, value: Any, kind: str) -> float:
        try:
            q = parse_quantity(value, kind)
        except ValueError as e:
            raise _err(where, text, table, index, key, str(e)) from None
        if not q > 0 or math.isinf(q):
            raise _err(where, text, table, index, key, f"must be positive and finite (got {value!r})")
        return q

    name = dev.get("name", "device")
    if not isinstance(name, str):
        raise _err(where, text, "device", None, "name", f"must be a string (got {name!r})")
    device = Device(
        name=name,
        memory=quantity("device", None, "memory", dev["memory"], "memory") if "memory" in dev else None,
        peak_flops=quantity("device", None, "peak_flops", dev["peak_flops"], "flops") if "peak_flops" in dev else None,
        memory_bandwidth=(quantity("device", None, "memory_bandwidth", dev["memory_bandwidth"], "bandwidth")
                          if "memory_bandwidth" in dev else None),
        peak_flops_bf16=(quantity("device", None, "peak_flops_bf16", dev["peak_flops_bf16"], "flops")
                         if "peak_flops_bf16" in dev else None),
        cores=cores,
    )
    raw_levels = d.get("levels")
    if not isinstance(raw_levels, list) or not raw_levels:
        raise ClusterSpecError(f"{where}: levels: missing [[levels]] tables (innermost first, each with count and bandwidth)")
    levels = []
    for i, lv in enumerate(raw_levels):
        if not isinstance(lv, Mapping):
            raise _err(where, text, "levels", i, None, "must be a table with name, count, bandwidth")
        lv_unknown = set(lv) - {"name", "count", "bandwidth"}
        if lv_unknown:
            raise _err(where, text, "levels", i, sorted(lv_unknown)[0], "unknown key (use name, count, bandwidth)")
        for key in ("count", "bandwidth"):
            if key not in lv:
                raise _err(where, text, "levels", i, None, f"missing key {key!r}")
        count = lv["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise _err(where, text, "levels", i, "count", f"must be a positive integer (got {count!r})")
        lname = lv.get("name", f"level{i}")
        if not isinstance(lname, str):
            raise _err(where, text, "levels", i, "name", f"must be a string (got {lname!r})")
        bw = quantity("levels", i, "bandwidth", lv["bandwidth"], "bandwidth")
        levels.append(Level(lname, count, bw))
    return ClusterSpec(device, tuple(levels))


def require_memory(cluster: ClusterSpec) -> float:
    """The device memory, or ClusterSpecError when it is missing (memory limits need it)."""
    if cluster.device.memory is None:
        raise ClusterSpecError(
            "device.memory: missing; the memory limit needs the per-worker memory "
            '(add memory = "16 GiB" under [device], or turn the memory limit off)'
        )
    return float(cluster.device.memory)


def _meminfo_bytes() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        return None
    return None


LOOPBACK_BANDWIDTH = 2e9  # bytes/s between two processes of this host (a local cluster's link; simulate charges it)


def local_cpu_cluster(workers: int, bandwidth: float = LOOPBACK_BANDWIDTH) -> ClusterSpec:
    """This machine as a cluster: ``workers`` processes on one level linked by loopback
    (``bandwidth`` bytes/s, 2 GB/s by default), each with an equal share of the RAM, sharing this
    host's cores (``Device.cores``: more busy processes than cores slow each other, which the cost
    model charges, ``roofline.contention``)."""
    if workers <= 0:
        raise ClusterSpecError(f"workers must be positive (got {workers})")
    total = _meminfo_bytes()
    memory = total / workers if total else None
    return ClusterSpec(
        Device("cpu", memory=memory, cores=host_cores()),
        (Level("processes", workers, float(bandwidth)),),
    )


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_V100_16 = Device("V100-16GB", memory=16 * 2.0**30, peak_flops=15.7e12, memory_bandwidth=900e9)


def paper_cluster(name: str, servers: int | None = None) -> ClusterSpec:
    """The PipeDream paper's clusters (SOSP'19 Table 1).

    ``"A"``: 4 servers x 4 V100 (16 GiB), PCIe inside a server (10 GB/s), 10 Gbit/s between.
    ``"B"``: 2 servers x 8 V100 (16 GiB), NVLink inside (300 GB/s), 25 Gbit/s between.
    ``servers`` overrides the number of servers (e.g. ``paper_cluster("B", 128)`` is 8 x 128).
    """
    key = name.upper()
    if key == "A":
        inner, n, outer, bw_in, bw_out = 4, 4, "servers", 10e9, 10e9 / 8
    elif key == "B":
        inner, n, outer, bw_in, bw_out = 8, 2, "servers", 300e9, 25e9 / 8
    else:
        raise ClusterSpecError(f"unknown paper cluster {name!r} (use 'A' or 'B')")
    if servers is not None:
        n = servers
    return ClusterSpec(
        _V100_16,
        (Level("gpus-in-server", inner, bw_in), Level(outer, n, bw_out)),
    )


def flat_cluster(workers: int, bandwidth: float, memory: float | None = None, name: str = "worker") -> ClusterSpec:
    """One level of ``workers`` at ``bandwidth`` bytes/s (tests, examples)."""
    return ClusterSpec(Device(name, memory=memory), (Level("workers", workers, float(bandwidth)),))
