"""The models the benchmarks train: GNNs, transformers and CNNs behind one interface, :class:`Workload`.

``build(name, size)`` gives the model in train mode and a ``make_batch(batch, generator)`` that *generates*
a learnable task (nothing is downloaded):

- GNNs train full-graph on a random graph shaped like ogbn-arxiv (169,343 nodes, 1,166,243 directed edges,
  128 features, 40 classes): features are a weak class centre plus noise and 65% of edges join nodes of one
  class (arxiv's homophily), so averaging over neighbours pays and accuracy rises within a few steps.
- BERT reads random token ids; the label says whether a marker token appears more than ``length // 4`` times.
- ViT and ResNet see a low-resolution class pattern, upsampled, plus unit noise.

Sizes: ``full`` is the published architecture (for a GPU), ``small`` trains a few steps in seconds on a
2-core CPU, ``tiny`` is the smallest that runs every code path (for the tests). The task (class centres and
patterns) comes from a fixed seed, so runs with different ``seed`` (model initialisation) learn the same task
and a batch generated later with another generator is a fair held-out set.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Workload", "SIZES", "names", "build", "accuracy", "ResNet", "Bottleneck", "GNN", "GNNLayer"]

SIZES = ("full", "small", "tiny")
TASK_SEED = 20240611  # the task's fixed parameters: independent of the model seed

Batch = tuple[tuple, torch.Tensor]


@dataclass
class Workload:
    name: str  # e.g. "gcn", "bert-base"
    family: str  # "gnn" | "transformer" | "cnn" | "llm"
    model: nn.Module  # on the device, in train mode
    make_batch: Callable[[int, torch.Generator], Batch]  # batch size (GNNs: nodes) -> (inputs, target)
    loss: Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]  # forward + scalar loss
    blocks: list[nn.Module]  # the repeated blocks, for per-block activation checkpointing
    default_batch: int
    metric: str  # "accuracy": every workload is a classification
    logits: Callable[[nn.Module, tuple], torch.Tensor]  # forward only: (batch or nodes, classes)
    source: str  # where the architecture comes from: "torch_geometric", "transformers (eager attention)",
    # "torchvision" or "compact" (this module's ResNet: no torchvision, or a narrowed small/tiny size)
    lr: float  # an Adam learning rate at which a few dozen steps lift accuracy above chance
    # The model's own gradient checkpointing, on or off (Hugging Face's ``gradient_checkpointing_enable``);
    # None: the benchmarks checkpoint each of ``blocks``.
    checkpointing: Callable[[bool], None] | None = None
    # The sub-batch the adaptive levels' sensitivity probe runs on, from a batch; None: its first samples.
    sub_batch: Callable[[tuple, torch.Tensor], Batch] | None = None
    tokens: int | None = None  # tokens a sample, where throughput is counted in tokens


def _classifier(
    name: str, family: str, model: nn.Module, logits: Callable[[nn.Module, tuple], torch.Tensor], **fields
) -> Workload:
    loss = lambda m, inputs, target: F.cross_entropy(logits(m, inputs), target)  # noqa: E731
    return Workload(name, family, model, loss=loss, logits=logits, metric="accuracy", **fields)


# ---------------------------------------------------------------------------------------------- GNNs

ARXIV_NODES, ARXIV_EDGES = 169_343, 1_166_243
GNN_DROPOUT = 0.5
HOMOPHILY = 0.65  # share of edges within a class: ogbn-arxiv's edge homophily
CENTRE_SCALE = 0.15  # class centres' scale against unit noise: alone, a node's features are a weak clue
GNN_LR = 1e-2  # the rate of OGB's ogbn-arxiv GCN/SAGE examples; at 1e-3, 15 steps barely move the loss
GAT_HEADS = 4  # hidden layers concatenate 4 heads of hidden/4 channels: the width stays `hidden`


@dataclass(frozen=True)
class GraphSize:
    hidden: int
    features: int
    classes: int
    nodes: int  # default_batch: full-graph training, so the batch is the graph


GRAPH_SIZES = {
    "full": GraphSize(hidden=256, features=128, classes=40, nodes=ARXIV_NODES),
    "small": GraphSize(hidden=64, features=128, classes=40, nodes=4_000),
    "tiny": GraphSize(hidden=16, features=32, classes=8, nodes=200),
}


def _conv(kind: str, d_in: int, d_out: int, last: bool) -> nn.Module:
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    if kind == "gcn":
        return GCNConv(d_in, d_out)
    if kind == "sage":
        return SAGEConv(d_in, d_out)
    heads = 1 if last else GAT_HEADS
    return GATConv(d_in, d_out // heads, heads=heads)


class GNNLayer(nn.Module):
    """A convolution with its norm, activation and dropout (none after the last): the unit checkpointed."""

    def __init__(self, conv: nn.Module, width: int | None) -> None:
        super().__init__()
        self.conv = conv
        post = [nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(GNN_DROPOUT)] if width else []
        self.post = nn.Sequential(*post)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.post(self.conv(x, edge_index))


class GNN(nn.Module):
    def __init__(self, kind: str, features: int, hidden: int, classes: int, layers: int = 3) -> None:
        super().__init__()
        widths = [features] + [hidden] * (layers - 1) + [classes]
        self.layers = nn.ModuleList(
            GNNLayer(_conv(kind, d_in, d_out, last=i == layers - 1), None if i == layers - 1 else d_out)
            for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:], strict=True))
        )

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, edge_index)
        return x


def _graph_batches(s: GraphSize, device: torch.device) -> Callable[[int, torch.Generator], Batch]:
    # Features: a fixed class centre plus unit noise; edges: homophilous like ogbn-arxiv's citations, where
    # about 65% of edges join papers of one subject. Averaging neighbours then sharpens the class signal.
    centres = CENTRE_SCALE * torch.randn(s.classes, s.features, generator=torch.Generator().manual_seed(TASK_SEED))

    def make_batch(n: int, gen: torch.Generator) -> Batch:
        y = torch.randint(0, s.classes, (n,), generator=gen)
        x = centres[y] + torch.randn(n, s.features, generator=gen)
        edges = round(n * ARXIV_EDGES / ARXIV_NODES)
        dst = torch.randint(0, n, (edges,), generator=gen)
        # A same-class source: a uniform pick within dst's class, among the nodes sorted by class.
        by_class, counts = y.argsort(), torch.bincount(y, minlength=s.classes)
        starts = counts.cumsum(0) - counts
        pick = (torch.rand(edges, generator=gen) * counts[y[dst]]).long()
        same = by_class[starts[y[dst]] + pick]
        src = torch.where(
            torch.rand(edges, generator=gen) < HOMOPHILY, same, torch.randint(0, n, (edges,), generator=gen)
        )
        edge_index = torch.stack([src, dst])  # messages flow source -> target, PyG's default
        return (x.to(device), edge_index.to(device)), y.to(device)

    return make_batch


def _gnn(name: str, size: str, device: torch.device) -> Workload:
    s = GRAPH_SIZES[size]
    model = GNN(name, s.features, s.hidden, s.classes)
    return _classifier(name, "gnn", model, lambda m, inputs: m(*inputs), make_batch=_graph_batches(s, device),
                       blocks=list(model.layers), default_batch=s.nodes, source="torch_geometric",
                       lr=GNN_LR)  # fmt: skip


# -------------------------------------------------------------------------------------- transformers

# name -> size -> (layers, hidden, heads, intermediate, vocab, sequence length, default batch)
BERT_SIZES = {
    "bert-base": {
        "full": (12, 768, 12, 3072, 30522, 128, 32),
        "small": (2, 128, 2, 512, 30522, 64, 16),
        "tiny": (2, 32, 2, 64, 256, 16, 4),
    },
    "bert-large": {
        "full": (24, 1024, 16, 4096, 30522, 128, 32),
        "6 layers": (6, 1024, 16, 4096, 30522, 128, 32),  # the GPU evaluation's compiled arm (compile time grows)
        "small": (4, 256, 4, 1024, 30522, 64, 16),
        "tiny": (3, 32, 2, 64, 256, 16, 4),
    },
}
# A few layers train at 1e-3 (small ViT: 10% to 97% held-out accuracy in 15 steps). The full stacks take BERT's
# pre-training rate instead: 12-24 post-LayerNorm layers without warm-up are the unstable case.
TRANSFORMER_LR = {"full": 1e-4, "6 layers": 1e-4, "small": 1e-3, "tiny": 1e-3}
# Small BERT at 1e-3 learns its task in 30 steps and then swings: its final loss moved from 0.003 to 0.5 with the
# dropout draws, whatever the method, so one run compared methods by chance. At 5e-4 every draw reaches 100%
# held-out accuracy in 30 steps, full precision and L1 within 0.005 of each other's loss (three seeds each).
BERT_SMALL_LR = 5e-4
CLS, MARKER, FIRST_WORD = 2, 3, 4  # ids below FIRST_WORD never occur at random: the marker is only where put

# size -> (image, patch, layers, hidden, heads, intermediate, labels, default batch)
VIT_SIZES = {
    "full": (224, 16, 12, 768, 12, 3072, 1000, 64),
    "small": (32, 8, 4, 128, 4, 512, 10, 32),
    "tiny": (16, 8, 2, 32, 2, 64, 4, 4),
}


def _attention_kwargs() -> dict:
    """Eager attention: the attention probabilities are saved for backward as a tensor of their own, as in
    the activation-compression papers; SDPA would keep them inside a fused kernel. Any transformers that
    knows ``attn_implementation`` (>= 4.36) takes it as a config argument; older ones ignore it."""
    return {"attn_implementation": "eager"}


def _token_batches(vocab: int, length: int, device: torch.device) -> Callable[[int, torch.Generator], Batch]:
    # The label: does the marker appear more than 2*step times? Counts avoid the boundary (0..step markers,
    # or 3*step..4*step) so that a few steps learn it: a 25% to 50% marker density against at most 12.5%.
    step = length // 8

    def make_batch(b: int, gen: torch.Generator) -> Batch:
        ids = torch.randint(FIRST_WORD, vocab, (b, length), generator=gen)
        y = torch.randint(0, 2, (b,), generator=gen)
        counts = 3 * step * y + torch.randint(0, step + 1, (b,), generator=gen)
        # A random permutation of the positions after [CLS]: the `count` lowest ranks get the marker.
        rank = torch.rand(b, length - 1, generator=gen).argsort(1)
        ids[:, 1:] = ids[:, 1:].masked_fill(rank < counts[:, None], MARKER)
        ids[:, 0] = CLS
        return (ids.to(device),), y.to(device)

    return make_batch


def _bert(name: str, size: str, device: torch.device) -> Workload:
    from transformers import BertConfig, BertForSequenceClassification

    layers, hidden, heads, intermediate, vocab, length, batch = BERT_SIZES[name][size]
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, num_labels=2, **_attention_kwargs())  # fmt: skip
    model = BertForSequenceClassification(config)
    fields = _encoder_fields(model, size) | ({"lr": BERT_SMALL_LR} if size == "small" else {})
    return _classifier(name, "transformer", model, lambda m, inputs: m(input_ids=inputs[0]).logits,
                       make_batch=_token_batches(vocab, length, device), default_batch=batch, **fields)  # fmt: skip


def _encoder_fields(model: nn.Module, size: str) -> dict:
    """Blocks, source and learning rate of a Hugging Face encoder. The layers are found by shape, as
    transformers moves them (``vit.encoder.layer`` in 4.x is ``vit.layers`` in 5.x): one ModuleList of
    ``num_hidden_layers`` modules of one class."""
    layers = model.config.num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
    blocks = next((list(m) for m in lists if len({type(b) for b in m}) == 1), None)
    if blocks is None:
        raise LookupError(f"no ModuleList of {layers} layers in {type(model).__name__}")
    attention = getattr(model.config, "_attn_implementation", None) or "default"
    return {"blocks": blocks, "source": f"transformers ({attention} attention)", "lr": TRANSFORMER_LR[size]}


def _image_batches(classes: int, image: int, device: torch.device) -> Callable[[int, torch.Generator], Batch]:
    # 8x8 class patterns, upsampled: 1000 classes cost 0.8 MB, not the 600 MB of full-resolution patterns.
    patterns = torch.randn(classes, 3, 8, 8, generator=torch.Generator().manual_seed(TASK_SEED))

    def make_batch(b: int, gen: torch.Generator) -> Batch:
        y = torch.randint(0, classes, (b,), generator=gen)
        signal = F.interpolate(patterns[y], size=(image, image), mode="bilinear", align_corners=False)
        x = signal + torch.randn(b, 3, image, image, generator=gen)
        return (x.to(device),), y.to(device)

    return make_batch


def _vit(name: str, size: str, device: torch.device) -> Workload:
    from transformers import ViTConfig, ViTForImageClassification

    image, patch, layers, hidden, heads, intermediate, labels, batch = VIT_SIZES[size]
    config = ViTConfig(image_size=image, patch_size=patch, num_hidden_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, intermediate_size=intermediate, num_labels=labels,
                       **_attention_kwargs())  # fmt: skip
    model = ViTForImageClassification(config)
    return _classifier(name, "transformer", model, lambda m, inputs: m(pixel_values=inputs[0]).logits,
                       make_batch=_image_batches(labels, image, device), default_batch=batch,
                       **_encoder_fields(model, size))  # fmt: skip


# ---------------------------------------------------------------------------------------------- CNNs


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (stride on the 3x3), with its attribute names."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet with a base width: at width 64 the same parameters and initialisation
    (``zero_init_residual`` as torchvision's: each block's last BatchNorm starts at zero, so that a block
    starts as the identity)."""

    def __init__(self, layers: tuple[int, ...], width: int = 64, classes: int = 1000,
                 zero_init_residual: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = width
        for i, count in enumerate(layers):
            planes, stage = width << i, []
            for j in range(count):
                stage.append(Bottleneck(inplanes, planes, stride=2 if i > 0 and j == 0 else 1))
                inplanes = planes * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.stages = len(layers)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(inplanes, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif zero_init_residual and isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


# name -> size -> (blocks per stage, base width, image, classes, default batch). Small keeps the network's
# depth (its 50 or 152 layers) and narrows it (a quarter of the width) on 32-pixel images: a step's peak is
# the saved activations of every block plus one block's backward, so a shallower stand-in would weigh that
# one backward several times more than the network it names does.
RESNET_SIZES = {
    "resnet50": {
        "full": ((3, 4, 6, 3), 64, 224, 1000, 64),
        "small": ((3, 4, 6, 3), 16, 32, 10, 32),
        "tiny": ((1, 1, 1, 1), 8, 16, 4, 4),
    },
    "resnet152": {
        "full": ((3, 8, 36, 3), 64, 224, 1000, 64),
        "small": ((3, 8, 36, 3), 16, 32, 10, 32),
        "tiny": ((1, 1, 2, 1), 8, 16, 4, 4),
    },
}

CNN_LR = 1e-3  # Adam's default: small ResNet-50, 10% to 58% held-out accuracy in 15 steps


def _resnet(name: str, size: str, device: torch.device) -> Workload:
    layers, width, image, classes, batch = RESNET_SIZES[name][size]
    # torchvision's ResNet cannot narrow its stages (64..512 are fixed), so only the full size can be its.
    if size == "full" and importlib.util.find_spec("torchvision") is not None:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=classes, zero_init_residual=True)
        source = "torchvision"
    else:
        model, source = ResNet(layers, width, classes, zero_init_residual=True), "compact"
    stages = [getattr(model, f"layer{i + 1}") for i in range(len(layers))]
    return _classifier(name, "cnn", model, lambda m, inputs: m(inputs[0]), blocks=[b for st in stages for b in st],
                       make_batch=_image_batches(classes, image, device), default_batch=batch, source=source,
                       lr=CNN_LR)  # fmt: skip


def _llama(name: str, size: str, device: torch.device) -> Workload:
    """``benchmarks/llm.py``'s LoRA model, from the seed ``build`` set; float32 weights where the device has no bf16
    autocast worth running (a CPU: the benchmarks' fp32 rows are fp32 there)."""
    from benchmarks import llm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return llm.build(size, device, seed=torch.initial_seed(), lora=True, dtype=dtype)


# --------------------------------------------------------------------------------------------- public

BUILDERS: dict[str, Callable[[str, str, torch.device], Workload]] = {
    "gcn": _gnn, "sage": _gnn, "gat": _gnn,
    "bert-base": _bert, "bert-large": _bert,
    "vit-b16": _vit,
    "resnet50": _resnet, "resnet152": _resnet,
    "llama-lora": _llama,
}  # fmt: skip


def names() -> list[str]:
    """Every workload name, GNNs first, then transformers, then CNNs, then the LLM."""
    return list(BUILDERS)


def build(name: str, size: str = "full", device: str | torch.device = "cpu", seed: int = 0) -> Workload:
    """The workload ``name`` at ``size`` on ``device``, its weights initialised from ``seed``.

    The weights are drawn on the CPU under ``seed`` (the caller's global RNG state is left as it was), so a
    seed gives the same model on every device."""
    if name not in BUILDERS:
        raise ValueError(f"name {name!r} is not one of {names()}")
    allowed = (*SIZES, *(s for s in BERT_SIZES.get(name, ()) if s not in SIZES))  # a model's own sizes too
    if size not in allowed:
        raise ValueError(f"size {size!r} is not one of {allowed}")
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed would reseed CUDA's too
        workload = BUILDERS[name](name, size, device)
    workload.model.to(device).train()
    return workload


def accuracy(workload: Workload, inputs: tuple, target: torch.Tensor) -> float:
    """Share of correct argmax predictions in eval mode (no dropout, BatchNorm running statistics), without
    autograd; the model's train/eval mode is restored afterwards."""
    model = workload.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            predicted = workload.logits(model, inputs).argmax(-1)
    finally:
        model.train(was_training)
    return (predicted == target).float().mean().item()
