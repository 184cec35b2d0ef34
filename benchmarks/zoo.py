"""Real architectures for the controller tests and the estimator and scheme benchmarks: each entry builds a model and
a loss closure.

``build(name, scale)`` returns ``(model, run)`` where ``run()`` does a forward pass and returns a scalar
loss. ``scale=1`` is small enough for hundreds of steps on a CPU; larger scales give several MB of
activations for the memory-ratio measurement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNetish(nn.Module):
    def __init__(self, c: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.blocks = nn.Sequential(Block(c), Block(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.blocks(self.pool(self.stem(x)))
        return self.head(x.mean((2, 3)))


class Scale(torch.autograd.Function):
    """A custom Function that saves its input and an output with save_for_backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x * w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        gy = g * (1 - y * y)
        return gy * w, (gy * x).sum(0)


class CustomFunctionNet(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(Scale.apply(x, self.w))


class InPlaceNet(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x).relu_()  # relu_ saves its output, then h is modified below: versions differ
        h = h * 2
        h.add_(1.0).sigmoid_()
        return self.b(h)


class DynamicNet(nn.Module):
    """Branches and sequence lengths change from call to call."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.even, self.odd, self.out = nn.Linear(d, d), nn.Sequential(nn.Linear(d, d), nn.GELU()), nn.Linear(d, 4)

    def forward(self, x):
        k = int(torch.randint(0, 6, ()))  # follows torch.manual_seed, so a test can replay a step
        x = x[:, : x.shape[1] - k % 3]  # a new "sequence length"
        h = self.even(x) if k % 2 == 0 else self.odd(x)
        for _ in range(k % 3):
            h = torch.tanh(self.even(h))  # a shared module called a varying number of times
        return self.out(h.mean(1))


class CheckpointedNet(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.mid = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.post = nn.Linear(d, 10)

    def forward(self, x):
        h = self.pre(x)
        h = h + checkpoint(self.mid, h, use_reentrant=False)
        return self.post(F.relu(h))


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor, forward=None) -> Callable[[], torch.Tensor]:
    forward = forward or model
    return lambda: F.cross_entropy(forward(x), y)


def mlp(s):
    m = nn.Sequential(nn.Linear(64, 128 * s), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128 * s, 128 * s), nn.GELU(),
                      nn.Linear(128 * s, 10))  # fmt: skip
    return m, _classify(m, torch.randn(32 * s, 64, generator=_gen()), torch.randint(0, 10, (32 * s,), generator=_gen()))


def resnet(s):
    m = ResNetish(16)
    x = torch.randn(8 * s, 3, 32 * s, 32 * s, generator=_gen())
    return m, _classify(m, x, torch.randint(0, 10, (8 * s,), generator=_gen()))


def transformer_layer(s):
    m = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    x = torch.randn(4 * s, 16 * s, 64, generator=_gen())
    return m, lambda: m(x).square().mean()


def bert(s):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=256, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    m = BertForSequenceClassification(cfg)
    ids = torch.randint(0, 200, (4 * s, 16 * s), generator=_gen())
    labels = torch.randint(0, 3, (4 * s,), generator=_gen())
    return m, lambda: m(input_ids=ids, labels=labels).loss


def _graph(s):
    n, e = 200 * s, 1000 * s
    x = torch.randn(n, 32, generator=_gen())
    edge_index = torch.randint(0, n, (2, e), generator=_gen())
    return x, edge_index, torch.randint(0, 5, (n,), generator=_gen())


class GNN(nn.Module):
    def __init__(self, conv: Callable[[int, int], nn.Module], hidden: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = conv(32, hidden), conv(hidden, 5)
        self.norm = nn.BatchNorm1d(hidden)

    def forward(self, x, edge_index):
        h = F.dropout(F.relu(self.norm(self.conv1(x, edge_index))), 0.2, self.training)
        return self.conv2(h, edge_index)


def _gnn(conv, s):
    x, ei, y = _graph(s)
    m = GNN(conv, 64)
    return m, lambda: F.cross_entropy(m(x, ei), y)


def gcn(s):
    from torch_geometric.nn import GCNConv

    return _gnn(GCNConv, s)


def sage(s):
    from torch_geometric.nn import SAGEConv

    return _gnn(SAGEConv, s)


def gat(s):
    from torch_geometric.nn import GATConv

    return _gnn(lambda i, o: GATConv(i, o, heads=2, concat=False), s)


class RNN(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn, self.head = cell(32, 64, num_layers=2, batch_first=True), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def lstm(s):
    m = RNN(nn.LSTM)
    return m, _classify(
        m, torch.randn(8 * s, 12 * s, 32, generator=_gen()), torch.randint(0, 10, (8 * s,), generator=_gen())
    )


def gru(s):
    m = RNN(nn.GRU)
    return m, _classify(
        m, torch.randn(8 * s, 12 * s, 32, generator=_gen()), torch.randint(0, 10, (8 * s,), generator=_gen())
    )


def conv3d(s):
    m = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(), nn.Conv3d(8, 8, 3, padding=1),
                      nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, 10))  # fmt: skip
    x = torch.randn(2 * s, 2, 8 * s, 8 * s, 8, generator=_gen())
    return m, _classify(m, x, torch.randint(0, 10, (2 * s,), generator=_gen()))


def custom_function(s):
    m = CustomFunctionNet(128)
    return m, lambda: m(torch.randn(64 * s, 128, generator=_gen())).square().mean()


def inplace(s):
    m = InPlaceNet(128)
    return m, lambda: m(torch.randn(64 * s, 128, generator=_gen())).square().mean()


def dynamic(s):
    m = DynamicNet(64)
    return m, lambda: m(torch.randn(8 * s, 32 * s, 64, generator=_gen())).square().mean()


def checkpointed(s):
    m = CheckpointedNet(64)
    return m, _classify(m, torch.randn(64 * s, 64, generator=_gen()), torch.randint(0, 10, (64 * s,), generator=_gen()))


ZOO: dict[str, Callable] = {
    "mlp": mlp, "resnet": resnet, "transformer_layer": transformer_layer, "bert": bert, "gcn": gcn, "sage": sage,
    "gat": gat, "lstm": lstm, "gru": gru, "conv3d": conv3d, "custom_function": custom_function,
    "inplace": inplace, "dynamic": dynamic, "checkpointed": checkpointed,
}  # fmt: skip


def build(name: str, scale: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    return ZOO[name](scale)


# Scales at which each model saves several MB of activations (for the compression-ratio measurement).
REALISTIC_SCALE = {name: 4 for name in ZOO} | {
    "mlp": 16, "resnet": 2, "gcn": 16, "sage": 16, "custom_function": 32, "inplace": 32, "checkpointed": 32,
}  # fmt: skip
