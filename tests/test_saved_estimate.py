"""What autograd saves, estimated for imported (PipeDream) profiles from each layer's description
(pdcompile.profile.estimate_saved), against what the saved-tensor hooks of annotate-costs measure
on the same models in torch: a VGG-16 laid out as PipeDream's profile (in-place ReLUs, max-pools,
``view``, dropout) and a residual block (batch norm, in-place add, average pool)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

from pdcompile.passes.annotate_costs import resaved_tensor_bytes, saved_tensor_bytes
from pdcompile.profile import estimate_saved, load, parse_pipedream


class VGG16(nn.Module):
    """torchvision's VGG-16 layout (what PipeDream profiled), ``width`` channels for its 64."""

    def __init__(self, width: int = 4, side: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        w = width
        cfg: list[Any] = [w, w, "M", 2 * w, 2 * w, "M", 4 * w, 4 * w, 4 * w, "M",
                          8 * w, 8 * w, 8 * w, "M", 8 * w, 8 * w, 8 * w, "M"]
        layers: list[nn.Module] = []
        c = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                side //= 2
            else:
                layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(c * side * side, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = x.view(x.size(0), -1)
        return self.classifier(x)


class Residual(nn.Module):
    """A ResNet basic block as PipeDream's ResNet profiles show it (``out += identity``)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu2 = nn.ReLU(inplace=True)
        self.pool = nn.AvgPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(x))
        out.add_(x)  # ``out += identity`` (fx would trace += as an out-of-place add)
        return self.pool(self.relu2(out))


def _desc(gm: fx.GraphModule, n: fx.Node) -> str:
    """PipeDream's description of a node: the module's repr, or its names for tensor methods."""
    if n.op == "call_module":
        return " ".join(str(gm.get_submodule(str(n.target))).split())
    if n.op == "call_method":
        return {"size": "Size(0)", "view": "View(-1)", "add_": "Add(inplace)"}[str(n.target)]
    raise AssertionError(f"no PipeDream description for {n.format_node()}")


def graph_txt(gm: fx.GraphModule, x: torch.Tensor) -> str:
    """The model in PipeDream's graph.txt format: each node's output bytes as activation_size."""
    values: dict[str, Any] = {}

    class Capture(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = result = super().run_node(n)
            return result

    with torch.no_grad():
        Capture(gm).run(x.clone())  # in-place ops write a copy, not x
    lines, edges = [], []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        v = values[n.name]
        size = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 4
        desc = "Input0" if n.op == "placeholder" else _desc(gm, n)
        lines.append(f"{n.name} -- {desc} -- forward_compute_time=1.000, backward_compute_time=1.000, "
                     f"activation_size={size:.1f}, parameter_size=0.000")
        edges += [f"\t{a.name} -- {n.name}" for a in n.all_input_nodes]
    return "\n".join(lines + edges) + "\n"


@pytest.mark.parametrize("model, x", [(VGG16(), torch.randn(2, 3, 32, 32)),
                                      (Residual(), torch.randn(2, 8, 8, 8))], ids=["vgg16", "residual"])
def test_estimate_equals_saved_tensor_hooks(model: nn.Module, x: torch.Tensor) -> None:
    model.train()
    gm = fx.symbolic_trace(model)
    measured = {n.name: v for n, v in saved_tensor_bytes(gm, (x,)).items()}
    # on CPU aten's dropout saves a float noise tensor (4 bytes per element); CUDA's native_dropout a bool mask
    profile = parse_pipedream(graph_txt(gm, x))
    layers = estimate_saved([replace(l, saved_bytes=None) for l in profile.layers], profile.inputs,
                            mask_bytes_per_element=4.0)
    assert len(layers) == len(measured) - 2  # the input and the output are not layers
    resaved = {n.name: v for n, v in resaved_tensor_bytes(gm, (x,)).items()}
    for layer in layers:
        got = (layer.saved_bytes, layer.saved_input_bytes, layer.saved_output_bytes)
        assert got == measured[layer.name], f"{layer.name} ({layer.desc})"
        # what it saves that an earlier layer saved first (a conv's input an in-place ReLU saved)
        assert layer.resaved_bytes == resaved[layer.name], f"{layer.name} ({layer.desc})"
    assert any(layer.resaved_bytes > 0 for layer in layers)
    # and the old convention (every output kept) is not what autograd keeps
    assert sum(l.saved_bytes or 0 for l in layers) < sum(l.output_bytes for l in layers)


def test_pipedream_vgg16_in_place_relus_count_once() -> None:
    """On PipeDream's own VGG-16 profile: a ReLU(inplace) keeps its conv's storage (saved once, by
    the ReLU; the next conv's input adds nothing), a max-pool its int64 indices, dropout its bool mask."""
    layers = {l.name: l for l in load("pipedream:vgg16").layers}
    relu, conv_next, pool, drop = layers["node3"], layers["node4"], layers["node6"], layers["node37"]
    assert relu.desc == "ReLU(inplace)" and relu.saved_bytes == relu.output_bytes
    assert conv_next.op == "Conv2d" and conv_next.saved_bytes == 0.0
    assert pool.op == "MaxPool2d" and pool.saved_bytes == 2 * pool.output_bytes  # input already saved by the ReLU
    assert drop.op == "Dropout" and drop.saved_bytes == drop.output_bytes / 4
