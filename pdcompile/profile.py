"""The profile file: per-layer costs of a model (a DAG of layers), read and written as JSON or
imported from PipeDream's ``graph.txt``.

A profile is what the planner needs to plan without the model: per layer, forward and backward
time, output activation bytes and parameter bytes, and the names of the layers it reads. It is
plain data (no torch), so a plan can be made on a laptop from a profile measured on a GPU server.
The JSON format (``version`` 1) is documented for users in README.md ("The profile format");
:class:`ProfileLayer` and :class:`ProfileInput` are its records.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from pdcompile.errors import ProfileError

FORMAT = "pdcompile-profile"
VERSION = 1

#: Optimizer state bytes per parameter byte (momentum buffer: 1x; Adam's two moments: 2x).
OPTIMIZER_STATE_FACTOR: dict[str, float] = {
    "sgd": 0.0,
    "sgd-momentum": 1.0,
    "adam": 2.0,
    "adamw": 2.0,
}


def optimizer_state_factor(optimizer: str) -> float:
    """Optimizer-state bytes per parameter byte for ``optimizer`` (e.g. ``"adam"`` -> 2.0)."""
    try:
        return OPTIMIZER_STATE_FACTOR[optimizer.lower()]
    except KeyError:
        raise ProfileError(
            f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_FACTOR)}"
        ) from None


@dataclass(frozen=True)
class ProfileInput:
    """A model input (an fx placeholder or a PipeDream ``InputN`` node): zero compute cost.

    Kept apart from layers, but a layer's ``inputs`` may name one. The time PipeDream recorded on
    its ``InputN`` nodes (data loading) is dropped, as PipeDream's own optimizer zeroes it."""

    name: str
    output_bytes: float = 0.0
    output_bytes_expr: str | None = None
    tensor_output: bool = True

    def __str__(self) -> str:
        return f"input {self.name} out {self.output_bytes:.0f} B"


@dataclass(frozen=True)
class ProfileLayer:
    """One layer: costs per minibatch of the profile's batch size, and the names it reads.

    ``tensor_output`` is false when the layer yields a non-tensor (an ``int``). The ``*_expr``
    fields are sympy expressions of the microbatch size ``b``, as strings, with ``symbolic_note``
    when a cost is not affine in ``b``."""

    name: str
    op: str
    forward_s: float
    backward_s: float
    output_bytes: float
    param_bytes: float
    inputs: tuple[str, ...] = ()
    desc: str = ""
    buffer_bytes: float = 0.0
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    tensor_output: bool = True
    output_bytes_expr: str | None = None
    forward_flops_expr: str | None = None
    backward_flops_expr: str | None = None
    symbolic_note: str = ""
    # bytes autograd saves for backward (None: unknown, as in imported profiles; planners then use
    # output_bytes), those of them an earlier layer produced, and of its own output (annotate-costs)
    saved_bytes: float | None = None
    saved_input_bytes: float = 0.0
    saved_output_bytes: float = 0.0
    shared_param_bytes: float = 0.0  # parameters an earlier layer uses too (tied across stages)
    # (name, bytes) of each parameter it uses that another layer uses too: where those layers are in different
    # stages, the runtime sums the parameter's gradients across them every step (the tied all-reduce)
    tied_params: tuple[tuple[str, float], ...] = ()
    # trainable parameter tensors it owns, each once at its first user (annotate-costs; 0: not profiled, as in
    # older and imported profiles): what the optimizer step and the all-reduce pay per tensor
    param_tensors: int = 0
    # a split backward's parts, input gradients only and parameter gradients only (None: not
    # profiled, as in older and imported profiles; the simulator then uses fixed shares)
    input_grad_s: float | None = None
    weight_grad_s: float | None = None
    # under selective recomputation (annotate-costs' selective_bytes): the bytes that stay saved per
    # microbatch (the cached outputs of its FLOP-counted ops) and the forward time rebuilt at backward
    # (None: not profiled, as in older and imported profiles)
    selective_saved_bytes: float | None = None
    selective_recompute_s: float | None = None
    selective_rebuilt_bytes: float | None = None  # of saved_bytes, what a backward's rebuild makes (not cached)
    resaved_bytes: float = 0.0  # what it saves that an earlier layer saved first (not in saved_bytes)
    # of forward_s and backward_s, the fixed part that does not scale with the batch (ops' fixed costs)
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def __str__(self) -> str:
        return (
            f"{self.name} {self.op} fwd {self.forward_s:.3e}s bwd {self.backward_s:.3e}s "
            f"out {self.output_bytes:.0f} B param {self.param_bytes:.0f} B "
            f"<- [{', '.join(self.inputs)}]"
        )


@dataclass(frozen=True)
class Profile:
    """A model's layer DAG with costs. ``layers`` are in a topological order.

    ``mode`` says where the times came from: ``"measured"``, ``"analytic"`` (FLOPs over a device
    spec) or ``"pipedream"`` (imported). ``outputs`` names the layers whose values leave the model
    (empty when unknown, as for PipeDream imports).
    """

    layers: tuple[ProfileLayer, ...]
    batch_size: int
    device: str = "unknown"
    version: int = VERSION
    name: str = "model"
    mode: str = "measured"
    optimizer: str = "sgd-momentum"
    inputs: tuple[ProfileInput, ...] = ()
    outputs: tuple[str, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        _validate(self, self.source or "<profile>")

    # -- totals ---------------------------------------------------------------------------
    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def param_bytes(self) -> float:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def output_bytes(self) -> float:
        return sum(layer.output_bytes for layer in self.layers)

    def optimizer_state_bytes(self) -> float:
        """Bytes of optimizer state for all parameters under ``self.optimizer``."""
        return self.param_bytes * optimizer_state_factor(self.optimizer)

    def layer(self, name: str) -> ProfileLayer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def at_batch_size(self, b: int) -> "Profile":
        """This profile evaluated at minibatch size ``b``.

        Bytes and FLOPs use the sympy expressions of ``b`` when a layer has them, else scale
        linearly with ``b / batch_size``. Times scale with the FLOPs expressions in analytic mode
        (time is FLOPs over throughput there) and linearly in ``b / batch_size`` otherwise, since
        a single measurement can't tell a fixed overhead from a per-sample cost. Parameter bytes
        don't depend on ``b``.
        """
        if b <= 0:
            raise ProfileError(f"batch size must be positive (got {b})")
        ratio = b / self.batch_size
        layers = []
        for layer in self.layers:
            out = _eval_or_scale(layer.output_bytes_expr, b, layer.output_bytes, ratio)
            ff = _eval_or_scale(layer.forward_flops_expr, b, layer.forward_flops, ratio)
            bf = _eval_or_scale(layer.backward_flops_expr, b, layer.backward_flops, ratio)
            if self.mode == "analytic" and layer.forward_flops_expr and layer.forward_flops:
                fs = layer.forward_s * ff / layer.forward_flops
            else:
                fs = layer.forward_s * ratio
            if self.mode == "analytic" and layer.backward_flops_expr and layer.backward_flops:
                bs = layer.backward_s * bf / layer.backward_flops
            else:
                bs = layer.backward_s * ratio
            b_scale = bs / layer.backward_s if layer.backward_s else ratio
            parts: dict[str, Any] = {k: None if getattr(layer, k) is None else getattr(layer, k) * b_scale
                                     for k in ("input_grad_s", "weight_grad_s")}
            saved: dict[str, Any] = {k: getattr(layer, k) * ratio
                                     for k in ("saved_input_bytes", "saved_output_bytes", "resaved_bytes")}
            f_scale = fs / layer.forward_s if layer.forward_s else ratio
            sel = layer.selective_recompute_s
            layers.append(
                replace(layer, forward_s=fs, backward_s=bs, output_bytes=out,
                        forward_flops=ff, backward_flops=bf, **saved, **parts,
                        saved_bytes=None if layer.saved_bytes is None else layer.saved_bytes * ratio,
                        selective_saved_bytes=(None if layer.selective_saved_bytes is None
                                               else layer.selective_saved_bytes * ratio),
                        selective_recompute_s=None if sel is None else sel * f_scale,
                        selective_rebuilt_bytes=(None if layer.selective_rebuilt_bytes is None
                                                 else layer.selective_rebuilt_bytes * ratio))
            )
        inputs = tuple(
            replace(i, output_bytes=_eval_or_scale(i.output_bytes_expr, b, i.output_bytes, ratio))
            for i in self.inputs
        )
        return replace(self, layers=tuple(layers), inputs=inputs, batch_size=b)

    def __str__(self) -> str:
        head = (
            f"profile {self.name}: {len(self.layers)} layers, {len(self.inputs)} inputs, "
            f"batch {self.batch_size}, device {self.device}, mode {self.mode}, "
            f"fwd {self.forward_s:.4e}s bwd {self.backward_s:.4e}s "
            f"params {self.param_bytes:.0f} B"
        )
        return "\n".join([head] + [f"  {i}" for i in self.inputs] + [f"  {l}" for l in self.layers])


# -- symbolic helpers ------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _compiled_expr(expr: str) -> Any:
    import sympy  # lazily: profile.py is imported by tools that never evaluate expressions

    b = sympy.Symbol("b", positive=True, integer=True)
    return sympy.sympify(expr, locals={"b": b}), b


def eval_expr(expr: str, b: int) -> float:
    """Evaluate a sympy expression string of the microbatch size ``b`` at ``b``."""
    e, sym = _compiled_expr(expr)
    value = e.subs(sym, b)
    try:
        result = float(value)
    except TypeError:
        result = math.nan
    if math.isnan(result):
        raise ProfileError(
            f"expression {expr!r} has no value at b={b} (a measured table that doesn't cover "
            f"b={b}?); profile again at this batch size"
        )
    return result


def _eval_or_scale(expr: str | None, b: int, value: float, ratio: float) -> float:
    return eval_expr(expr, b) if expr else value * ratio


# -- validation ------------------------------------------------------------------------------


def _validate(profile: Profile, where: str, lines: Mapping[str, int] | None = None) -> None:
    """Check names are unique, every input exists, no negative cost, layers are topological."""

    def at(name: str) -> str:
        return f"{where}:{lines[name]}" if lines and name in lines else where

    if profile.batch_size <= 0:
        raise ProfileError(f"{where}: batch_size must be positive (got {profile.batch_size})")
    seen: set[str] = set()
    for i in profile.inputs:
        if i.name in seen:
            raise ProfileError(f"{at(i.name)}: duplicate name {i.name!r}; names must be unique")
        seen.add(i.name)
    all_names = seen | {layer.name for layer in profile.layers}
    for layer in profile.layers:
        if layer.name in seen:
            raise ProfileError(
                f"{at(layer.name)}: duplicate name {layer.name!r}; names must be unique"
            )
        for key in ("forward_s", "backward_s", "output_bytes", "param_bytes"):
            v = getattr(layer, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ProfileError(
                    f"{at(layer.name)}: layer {layer.name!r} has {key}={v!r}; costs must be "
                    f"finite and non-negative"
                )
        for src in layer.inputs:
            if src not in all_names:
                raise ProfileError(
                    f"{at(layer.name)}: layer {layer.name!r} reads {src!r}, which is neither a "
                    f"layer nor a model input; add it or remove the reference"
                )
            if src not in seen:
                raise ProfileError(
                    f"{at(layer.name)}: layer {layer.name!r} reads {src!r}, which comes later; "
                    f"layers must be in topological order (is there a cycle?)"
                )
        seen.add(layer.name)
    for name in profile.outputs:
        if name not in all_names:
            raise ProfileError(f"{where}: output {name!r} is not a layer or input")
    _check_totals(profile, where)


#: Headroom the planner needs above a profile's totals: it multiplies them by worker, replica and
#: microbatch counts (and by 4 for a ring all-reduce's traffic) without overflowing a float.
_TOTAL_HEADROOM = 1e6


def _check_totals(profile: Profile, where: str) -> None:
    """Refuse costs whose sums overflow: each finite, but their total is inf (or near it), so every
    plan would cost inf and the planner's answers (infeasible, or 'fits in 32 B') would be noise."""
    for key, unit in (("forward_s", "s"), ("backward_s", "s"), ("output_bytes", "B"), ("param_bytes", "B")):
        values = [(layer.name, float(getattr(layer, key))) for layer in profile.layers]
        if key == "output_bytes":
            values += [(i.name, float(i.output_bytes)) for i in profile.inputs]
        total = sum((v for _, v in values), 0.0)  # plain floats: an overflow gives inf, no exception
        if not (math.isfinite(total) and math.isfinite(total * _TOTAL_HEADROOM)):
            name, big = max(values, key=lambda nv: nv[1])
            raise ProfileError(
                f"{where}: the layers' {key} sum to {total:.3g} {unit}, too large to plan with (overflows a "
                f"float; e.g. {name!r} has {key}={big:.3g}); costs are per minibatch in seconds and bytes: "
                f"fix the profile's units or measure it again"
            )


def topological_order(
    names: list[str], preds: Mapping[str, Iterable[str]], where: str,
    edge_lines: Mapping[tuple[str, str], int] | None = None,
) -> list[str]:
    """Kahn's algorithm, taking ready nodes in the order of ``names``; raises on a cycle,
    naming the last line (per ``edge_lines``) of an edge on it."""
    import heapq

    index = {n: i for i, n in enumerate(names)}
    succs: dict[str, list[str]] = {n: [] for n in names}
    indeg = {n: 0 for n in names}
    for n in names:
        for p in preds.get(n, ()):
            succs[p].append(n)
            indeg[n] += 1
    heap = [index[n] for n in names if indeg[n] == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        n = names[heapq.heappop(heap)]
        order.append(n)
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, index[s])
    if len(order) != len(names):
        stuck = sorted((n for n in names if indeg[n] > 0), key=index.__getitem__)
        cycle = _find_cycle(stuck, preds)
        lines_of = edge_lines or {}
        cycle_lines = [lines_of[e] for e in zip(cycle, cycle[1:]) if e in lines_of]
        loc = f"{where}:{max(cycle_lines)}" if cycle_lines else where
        raise ProfileError(
            f"{loc}: the layer graph has a cycle ({' -> '.join(cycle)}); a profile must be a DAG, "
            f"remove one of these edges"
        )
    return order


def _find_cycle(stuck: list[str], preds: Mapping[str, Iterable[str]]) -> list[str]:
    """A cycle among ``stuck`` nodes (every stuck node has a stuck predecessor)."""
    stuck_set = set(stuck)
    path: list[str] = []
    pos: dict[str, int] = {}
    node = stuck[0]
    while node not in pos:
        pos[node] = len(path)
        path.append(node)
        node = next(p for p in preds.get(node, ()) if p in stuck_set)
    cycle = path[pos[node]:][::-1]
    return cycle + [cycle[0]]


# -- JSON ------------------------------------------------------------------------------------

_LAYER_FIELDS = {f.name for f in fields(ProfileLayer)}
_INPUT_FIELDS = {f.name for f in fields(ProfileInput)}


def to_json(profile: Profile) -> dict[str, Any]:
    """The profile as a JSON-serialisable dict (the file format)."""
    layer_defaults = {f.name: f.default for f in fields(ProfileLayer)}

    def layer_dict(layer: ProfileLayer) -> dict[str, Any]:
        d = asdict(layer)
        d["inputs"] = list(layer.inputs)
        # Required fields always; optional ones only when set, to keep files readable.
        return {k: v for k, v in d.items()
                if k in _REQUIRED_LAYER or v != layer_defaults.get(k)}

    return {
        "format": FORMAT,
        "version": profile.version,
        "name": profile.name,
        "device": profile.device,
        "batch_size": profile.batch_size,
        "mode": profile.mode,
        "optimizer": profile.optimizer,
        "inputs": [asdict(i) for i in profile.inputs],
        "outputs": list(profile.outputs),
        "layers": [layer_dict(layer) for layer in profile.layers],
    }


_REQUIRED_LAYER = ("name", "op", "forward_s", "backward_s", "output_bytes", "param_bytes", "inputs")


def from_json(data: Mapping[str, Any], where: str = "<json>") -> Profile:
    """Build a Profile from the dict :func:`to_json` makes; errors name ``where``."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where}: expected a JSON object at the top level")
    if data.get("format") != FORMAT:
        raise ProfileError(
            f"{where}: not a pdcompile profile (format={data.get('format')!r}, "
            f"expected {FORMAT!r})"
        )
    version = data.get("version")
    if version != VERSION:
        raise ProfileError(
            f"{where}: profile version {version!r} is not supported (this pdcompile reads "
            f"version {VERSION}); profile the model again"
        )
    for key in ("batch_size", "layers"):
        if key not in data:
            raise ProfileError(f"{where}: missing key {key!r}")
    for key in ("layers", "inputs", "outputs"):
        if key in data and not (isinstance(data[key], list)
                                and all(isinstance(x, Mapping if key != "outputs" else str) for x in data[key])):
            kind = "objects" if key != "outputs" else "names"
            raise ProfileError(f"{where}: {key!r} must be a list of {kind}, got {type(data[key]).__name__}")
    layers = []
    for k, d in enumerate(data["layers"]):
        missing = [f for f in _REQUIRED_LAYER if f not in d]
        unknown = sorted(set(d) - _LAYER_FIELDS)
        if missing or unknown:
            raise ProfileError(
                f"{where}: layer #{k} ({d.get('name', '?')!r}) "
                + (f"lacks {missing}" if missing else f"has unknown keys {unknown}")
            )
        try:
            tied = tuple((str(n), float(b)) for n, b in d.get("tied_params", ()))
        except (TypeError, ValueError):
            raise ProfileError(f"{where}: layer #{k} ({d.get('name', '?')!r}): tied_params must be a list of "
                               f"[parameter name, bytes] pairs") from None
        layers.append(ProfileLayer(**{**d, "inputs": tuple(d["inputs"]), "tied_params": tied}))
    inputs = []
    for d in data.get("inputs", []):
        unknown = sorted(set(d) - _INPUT_FIELDS)
        if unknown or "name" not in d:
            raise ProfileError(f"{where}: model input {d!r} is malformed")
        inputs.append(ProfileInput(**d))
    return Profile(
        layers=tuple(layers),
        batch_size=int(data["batch_size"]),
        device=str(data.get("device", "unknown")),
        version=VERSION,
        name=str(data.get("name", "model")),
        mode=str(data.get("mode", "measured")),
        optimizer=str(data.get("optimizer", "sgd-momentum")),
        inputs=tuple(inputs),
        outputs=tuple(data.get("outputs", ())),
        source=where,
    )


def save(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as JSON to ``path``."""
    Path(path).write_text(json.dumps(to_json(profile), indent=1) + "\n")


# -- PipeDream's published profiles, shipped in the package ------------------------------------

#: The folder of PipeDream's fourteen ``graph.txt`` profiles (MIT, msr-fiddle/pipedream).
PIPEDREAM_DIR = Path(__file__).resolve().parent / "profiles" / "pipedream"
PIPEDREAM_PREFIX = "pipedream:"


def pipedream_profiles() -> list[str]:
    """Names of the shipped PipeDream profiles (``vgg16``, ``gnmt``, ...), sorted."""
    return sorted(p.stem for p in PIPEDREAM_DIR.glob("*.txt"))


def resolve_path(path: str | Path) -> Path:
    """``pipedream:NAME`` -> the shipped profile's file; any other path unchanged.

    An unknown NAME raises :class:`ProfileError` listing the available ones."""
    text = str(path)
    if text.startswith(PIPEDREAM_PREFIX):
        name = text[len(PIPEDREAM_PREFIX):].removesuffix(".txt")
        names = pipedream_profiles()
        if name not in names:
            raise ProfileError(f"{text!r}: no such PipeDream profile; use one of "
                               f"{', '.join(PIPEDREAM_PREFIX + n for n in names)}")
        return PIPEDREAM_DIR / f"{name}.txt"
    if not text:
        raise ProfileError("no profile given (an empty path); give a profile JSON, a PipeDream graph.txt "
                           "or pipedream:NAME")
    return Path(path)


def _read_profile_text(path: str | Path) -> tuple[Path, str]:
    """(the resolved path, its text); a missing, unreadable or empty file is a ProfileError."""
    p = resolve_path(path)
    if p.is_dir():
        raise ProfileError(f"{p}: is a folder, not a profile; give a profile JSON, a PipeDream graph.txt "
                           f"or pipedream:NAME")
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ProfileError(f"{p}: cannot read profile (no such file); give a profile JSON (pdcompile profile "
                           f"-o FILE), a PipeDream graph.txt or pipedream:NAME") from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not text"
        raise ProfileError(f"{p}: cannot read profile ({why})") from None
    if not text.strip():
        what = "is empty (0 bytes)" if not text else f"holds only whitespace ({len(text.encode())} bytes)"
        raise ProfileError(f"{p}: the file {what}, not a profile; write one into it (pdcompile profile MODEL "
                           f"-o {p.name}) or give another file")
    return p, text


def load(path: str | Path) -> Profile:
    """Read a profile: our JSON, or a PipeDream ``graph.txt`` (detected from the content), or
    ``pipedream:NAME`` (one of PipeDream's published profiles, shipped in the package)."""
    p, text = _read_profile_text(path)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{p}:{e.lineno}: invalid JSON ({e.msg})") from None
        return from_json(data, str(p))
    return parse_pipedream(text, str(p))


# -- PipeDream graph.txt ---------------------------------------------------------------------

_NODE_RE = re.compile(r"^(?P<id>\S+) -- (?P<desc>.*) -- (?P<metrics>[a-z_]+=.*)$")
_EDGE_RE = re.compile(r"^(?P<src>\S+) -- (?P<dst>\S+)$")
_METRIC_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size",
                "parameter_size")
_INPUT_DESC = re.compile(r"^Input\d*$")


def load_pipedream(path: str | Path, batch_size: int | None = None) -> Profile:
    """Read a PipeDream profiler ``graph.txt`` (times in ms per minibatch, stored as seconds), or
    ``pipedream:NAME``."""
    p, text = _read_profile_text(path)
    return parse_pipedream(text, str(p), batch_size=batch_size)


def _parse_size(raw: str, where: str) -> float:
    """``123.0`` or a multi-output list ``[a; b; c]`` (summed: all of them are the output)."""
    raw = raw.strip()
    if raw.startswith("[") and raw.endswith("]"):
        parts = [x for x in raw[1:-1].split(";") if x.strip()]
        return sum(_parse_float(x, where) for x in parts)
    return _parse_float(raw, where)


def _parse_float(raw: str, where: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ProfileError(f"{where}: {raw.strip()!r} is not a number") from None


def parse_pipedream(text: str, where: str = "<graph.txt>", batch_size: int | None = None) -> Profile:
    """Parse the text of a PipeDream ``graph.txt``; see :func:`load_pipedream`.

    PipeDream's files don't record the batch size; ``batch_size`` defaults to 1 (the costs are
    per minibatch either way). Layers come out in a topological order that prefers the node
    numbers PipeDream assigned (its trace order).
    """
    descs: dict[str, str] = {}
    metrics: dict[str, dict[str, float]] = {}
    lines: dict[str, int] = {}
    preds: dict[str, list[str]] = {}
    edges: list[tuple[str, str, int]] = []
    edge_lines: dict[tuple[str, str], int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        loc = f"{where}:{lineno}"
        if raw[0] in "\t ":
            m = _EDGE_RE.match(raw.strip())
            if not m:
                raise ProfileError(
                    f"{loc}: malformed edge line {raw.strip()!r}; expected '\\tnodeA -- nodeB'"
                )
            edges.append((m["src"], m["dst"], lineno))
            continue
        m = _NODE_RE.match(raw)
        if not m:
            raise ProfileError(
                f"{loc}: malformed node line {raw[:80]!r}; expected 'nodeN -- description -- "
                f"forward_compute_time=ms, backward_compute_time=ms, activation_size=bytes, "
                f"parameter_size=bytes'"
            )
        node = m["id"]
        if node in descs:
            raise ProfileError(f"{loc}: node {node!r} defined twice (first on line {lines[node]})")
        vals: dict[str, float] = {}
        for item in re.split(r",\s*(?=[a-z_]+=)", m["metrics"]):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in _METRIC_KEYS:
                raise ProfileError(f"{loc}: unknown metric {key!r}; expected {list(_METRIC_KEYS)}")
            vals[key] = _parse_size(value, loc)
        missing = [k for k in _METRIC_KEYS if k not in vals]
        if missing:
            raise ProfileError(f"{loc}: node {node!r} lacks {missing}")
        for k, v in vals.items():
            if not math.isfinite(v) or v < 0:
                raise ProfileError(
                    f"{loc}: node {node!r} has {k}={v}; times and sizes must be non-negative"
                )
        descs[node] = m["desc"].strip()
        metrics[node] = vals
        lines[node] = lineno
        preds[node] = []
    for src, dst, lineno in edges:
        for n in (src, dst):
            if n not in descs:
                raise ProfileError(
                    f"{where}:{lineno}: edge {src} -- {dst} names {n!r}, which has no node line; "
                    f"add the node or remove the edge"
                )
        if src not in preds[dst]:
            preds[dst].append(src)
        edge_lines[(src, dst)] = lineno
    if not descs:
        raise ProfileError(f"{where}: no nodes found; is this a PipeDream graph.txt?")

    names = sorted(descs, key=_natural_key)
    order = topological_order(names, preds, where, edge_lines)
    inputs: list[ProfileInput] = []
    layers: list[ProfileLayer] = []
    for node in order:
        desc, vals = descs[node], metrics[node]
        if _INPUT_DESC.match(desc) and not preds[node]:
            inputs.append(ProfileInput(name=node, output_bytes=vals["activation_size"]))
            continue
        layers.append(
            ProfileLayer(
                name=node,
                op=_op_of(desc),
                forward_s=vals["forward_compute_time"] / 1e3,
                backward_s=vals["backward_compute_time"] / 1e3,
                output_bytes=vals["activation_size"],
                param_bytes=vals["parameter_size"],
                inputs=tuple(preds[node]),
                desc=desc,
            )
        )
    return Profile(
        layers=estimate_saved(layers, inputs),
        batch_size=batch_size or 1,
        device="unknown (PipeDream profile)",
        name=Path(where).stem if not where.startswith("<") else "pipedream",
        mode="pipedream",
        inputs=tuple(inputs),
        source=where,
    )


# -- what autograd saves, estimated from a layer's description --------------------------------
#
# An imported profile (PipeDream's graph.txt) gives each layer's output bytes, not what autograd
# keeps for its backward. Counting every output as kept counts an in-place ReLU's output, which is
# its producer's storage, twice, and misses a max-pool's indices. The rule below is what each op's
# backward formula in PyTorch's tools/autograd/derivatives.yaml saves (parameters and buffers are
# not activations and are left out), applied as annotate-costs' saved-tensor hooks count
# (passes/annotate_costs.py `saved_tensor_bytes`): each storage once, at the first layer that saves
# it; in-place ops and views share their input's storage. Elements are taken as 4-byte floats (the
# profiles are fp32). tests/test_profile.py checks it against the hooks on a VGG-16 in torch.
#
#   Conv2d (convolution_backward)        its input (and weight)
#   Linear (addmm / mm)                  its input (and weight)
#   BatchNorm2d (native_batch_norm)      its input, and per channel save_mean and save_invstd
#   AvgPool2d (avg_pool2d_backward)      its input
#   MaxPool2d (max_pool2d_with_indices)  its input, and the int64 indices (2x its fp32 output)
#   ReLU, in place or not (threshold_backward on result)   its output
#   Dropout in training                  its mask: on CUDA native_dropout's bool mask (1/4 of its fp32
#                                        output); on CPU aten's _dropout_impl multiplies by a float
#                                        noise tensor and saves that (its output's bytes)
#   Embedding (embedding_backward)       its (int64) input indices
#   Add, Concat, View, Size, __getitem__ nothing (Add(inplace), View and __getitem__ alias their input)
#   anything else (LSTM, composite modules)  its output, as before: unknown, so the old convention

_SAVES_INPUT = frozenset({"Conv1d", "Conv2d", "Conv3d", "ConvNd", "Linear", "BatchNorm1d", "BatchNorm2d",
                          "BatchNormNd", "AvgPool1d", "AvgPool2d", "AvgPoolNd", "AdaptiveAvgPool2d",
                          "MaxPool1d", "MaxPool2d", "MaxPoolNd", "Embedding"})
_SAVES_OUTPUT = frozenset({"ReLU", "ReLU6", "Sigmoid", "Tanh"})
_SAVES_NOTHING = frozenset({"Add", "Concat", "View", "Size", "__getitem__", "Flatten", "Identity"})
_ALIASES = frozenset({"View", "Flatten", "Identity"})
_INPLACE = re.compile(r"\binplace(?!\s*=\s*False)\b")


def _saved_rule(layer: ProfileLayer, mask_bytes: float) -> tuple[bool, bool, float, bool]:
    """(saves its inputs, saves its output, extra bytes it saves, its output aliases its first input)."""
    op, out = layer.op, layer.output_bytes
    inplace = bool(_INPLACE.search(layer.desc)) and bool(layer.inputs)
    alias = (inplace or op in _ALIASES) and bool(layer.inputs)
    if op.startswith("MaxPool"):
        return True, False, 2.0 * out, alias
    if op in _SAVES_INPUT:
        extra = 0.0
        if op.startswith("BatchNorm"):
            m = re.match(r"\w+\((\d+)", layer.desc)
            extra = 2.0 * 4.0 * int(m.group(1)) if m else 0.0
        return True, False, extra, alias
    if op in _SAVES_OUTPUT:
        return False, True, 0.0, alias
    if op == "Dropout":
        return False, False, out * mask_bytes / 4.0, alias
    if op in _SAVES_NOTHING:
        return False, False, 0.0, alias
    return False, True, 0.0, alias


def estimate_saved(layers: Iterable[ProfileLayer], inputs: Iterable[ProfileInput] = (), *,
                   mask_bytes_per_element: float = 1.0) -> tuple[ProfileLayer, ...]:
    """``layers`` (in a topological order) with ``saved_bytes``, ``saved_input_bytes`` and
    ``saved_output_bytes`` (and ``resaved_bytes``: what it saves that an earlier layer saved first)
    estimated from each layer's op (the rule above), split as
    annotate-costs' hooks split them: bytes of storages this layer's output is (``saved_output``),
    the rest, an earlier layer's or input's storage or the op's own extras such as indices
    (``saved_input``). ``mask_bytes_per_element``: a dropout mask's element (1: CUDA, where
    PipeDream's profiles were taken; 4: CPU). Layers that already carry measured ``saved_bytes``
    are kept as they are."""
    layers = tuple(layers)
    if any(l.saved_bytes is not None for l in layers):
        return layers
    storage: dict[str, str] = {i.name: i.name for i in inputs}  # value -> its storage (an alias's base)
    nbytes: dict[str, float] = {i.name: float(i.output_bytes) for i in inputs}
    scalar = {l.name for l in layers if l.op == "Size" or not l.tensor_output}
    seen: set[str] = set()
    out: list[ProfileLayer] = []
    for layer in layers:
        saves_in, saves_out, extra, alias = _saved_rule(layer, mask_bytes_per_element)
        tensors = [storage.get(p, p) for p in layer.inputs if p not in scalar]
        base = layer.name
        if alias and tensors:  # the input it writes or views; of an in-place Add's two, one not yet saved
            base = next((t for t in tensors if t not in seen), tensors[0])
        storage[layer.name] = base
        nbytes.setdefault(base, float(layer.output_bytes))
        wanted = tensors if saves_in else []
        if saves_out:
            wanted.append(base)
        total, mine, again = extra, 0.0, 0.0
        for st in dict.fromkeys(wanted):
            if st in seen:  # an earlier layer saved it first: counted there (and kept by this one too)
                again += nbytes.get(st, 0.0)
                continue
            seen.add(st)
            total += nbytes.get(st, 0.0)
            if st == layer.name:
                mine += nbytes[st]
        out.append(replace(layer, saved_bytes=total, saved_input_bytes=total - mine, saved_output_bytes=mine,
                           resaved_bytes=again))
    return tuple(out)


def _op_of(desc: str) -> str:
    """``Conv2d(3, 64, ...)`` -> ``Conv2d``; ``__getitem__(0)`` -> ``__getitem__``."""
    m = re.match(r"[A-Za-z_][A-Za-z0-9_.]*", desc)
    return m.group(0) if m else (desc or "?")


def _natural_key(name: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


__all__ = [
    "FORMAT", "VERSION", "OPTIMIZER_STATE_FACTOR", "Profile", "ProfileInput", "ProfileLayer",
    "PIPEDREAM_DIR", "estimate_saved", "eval_expr", "from_json", "load", "load_pipedream", "optimizer_state_factor",
    "parse_pipedream", "pipedream_profiles", "resolve_path", "save", "to_json", "topological_order",
]
