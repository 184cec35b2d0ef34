"""Models written by other projects whose backward reads saved tensors nonlinearly: torch_geometric's PNA
(min/max aggregation), a GCN with global max pooling, GIN, GINE and GAT, Hugging Face's Wav2Vec2 with a CTC
head and T5, each built from a config on generated data. Gradients must be finite at every level and
within cosine 0.999 of plain PyTorch at 8 bits."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx

LEVELS = ["L1.1", "L1", "L1.2", "L2.2"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _graphs(n=96, e=384, features=16, graphs=4):
    x = torch.randn(n, features, generator=_gen())
    edge_index = torch.randint(0, n, (2, e), generator=_gen(1))
    batch = torch.arange(n) * graphs // n
    return x, edge_index, batch


class GraphClassifier(nn.Module):
    """Two message-passing layers, global max pooling (``global_max_pool``: scatter with amax), a head."""

    def __init__(self, conv1, conv2, edge_dims=None):
        super().__init__()
        self.conv1, self.conv2, self.head = conv1, conv2, nn.Linear(32, 3)
        self.edges = None if edge_dims is None else nn.ModuleList(nn.Linear(4, d) for d in edge_dims)

    def forward(self, x, edge_index, batch, edge_attr=None):
        from torch_geometric.nn import global_max_pool

        extra = [()] * 2 if self.edges is None else [(e(edge_attr),) for e in self.edges]
        h = F.relu(self.conv1(x, edge_index, *extra[0]))
        h = F.relu(self.conv2(h, edge_index, *extra[1]))
        return self.head(global_max_pool(h, batch))


def _graph_case(make):
    x, edge_index, batch = _graphs()
    model, edge_attr = make()
    y = torch.tensor([0, 1, 2, 1])
    extra = () if edge_attr is None else (edge_attr,)
    return model, lambda: F.cross_entropy(model(x, edge_index, batch, *extra), y)


def pna():
    from torch_geometric.nn import PNAConv
    from torch_geometric.utils import degree

    _, edge_index, _ = _graphs()
    deg = torch.bincount(degree(edge_index[1], 96, dtype=torch.long))
    aggregators, scalers = ["mean", "min", "max", "std"], ["identity", "amplification", "attenuation"]
    conv = lambda i, o: PNAConv(i, o, aggregators, scalers, deg)  # noqa: E731
    return GraphClassifier(conv(16, 32), conv(32, 32)), None


def gcn_max_pool():
    from torch_geometric.nn import GCNConv

    return GraphClassifier(GCNConv(16, 32), GCNConv(32, 32)), None


def gin():
    from torch_geometric.nn import GINConv

    mlp = lambda i: nn.Sequential(nn.Linear(i, 32), nn.ReLU(), nn.Linear(32, 32))  # noqa: E731
    return GraphClassifier(GINConv(mlp(16), train_eps=True), GINConv(mlp(32))), None


def gine():
    from torch_geometric.nn import GINEConv

    mlp = lambda i: nn.Sequential(nn.Linear(i, 32), nn.GELU(), nn.Linear(32, 32))  # noqa: E731
    edge_attr = torch.randn(384, 4, generator=_gen(2))
    return GraphClassifier(GINEConv(mlp(16), edge_dim=16), GINEConv(mlp(32), edge_dim=32), (16, 32)), edge_attr


def gat():
    from torch_geometric.nn import GATConv

    return GraphClassifier(GATConv(16, 16, heads=2), GATConv(32, 32, heads=2, concat=False)), None


def wav2vec2_ctc():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(config)
    audio = torch.randn(2, 1600, generator=_gen())
    labels = torch.randint(1, 12, (2, 12), generator=_gen(1))
    return model, lambda: model(audio, labels=labels).loss


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        feed_forward_proj="gated-gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, 64, (4, 24), generator=_gen())
    labels = torch.randint(1, 64, (4, 16), generator=_gen(1))
    return model, lambda: model(input_ids=ids, labels=labels).loss


MODELS = {
    "pna": lambda: _graph_case(pna),
    "gcn_global_max_pool": lambda: _graph_case(gcn_max_pool),
    "gin": lambda: _graph_case(gin),
    "gine": lambda: _graph_case(gine),
    "gat": lambda: _graph_case(gat),
    "wav2vec2_ctc": wav2vec2_ctc,
    "t5": t5,
}


def _grads(model, run, controller=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # same dropout masks in every run
    if controller is None:
        loss = run()
    else:
        with controller:
            loss = run()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_finite_at_every_level_and_close_at_8_bits(name):
    torch.manual_seed(0)
    model, run = MODELS[name]()
    plain = _grads(model, run)
    assert torch.isfinite(plain).all()
    assert torch.equal(_grads(model, run, gactx.Controller(model, level="L0")), plain)
    for level in LEVELS:
        controller = gactx.Controller(model, level=level)
        if controller.config.adaptive:
            with controller:
                run().backward()
                controller.adapt(lambda: run().backward())
        got = _grads(model, run, controller)
        assert torch.isfinite(got).all(), f"{name} at {level}: {int((~torch.isfinite(got)).sum())} non-finite"
        if level == "L1.1":
            cosine = F.cosine_similarity(got, plain, dim=0)
            assert cosine >= 0.999, f"{name} at 8 bits: cosine {float(cosine):.5f}"
