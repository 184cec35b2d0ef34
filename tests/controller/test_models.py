"""Models written by other projects whose backward reads saved tensors nonlinearly: torch_geometric's PNA
(min/max aggregation), a GCN with global max pooling, GIN, GINE and GAT, Hugging Face's Wav2Vec2 with a CTC
head and T5, each built from a config on generated data. Gradients must be finite at every level and
within cosine 0.999 of plain PyTorch at 8 bits. Wav2Vec2's watched first step records what later steps do, but for
the integer saves torch's CTC loss makes under any dispatch mode."""

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


def test_wav2vec2_ctc_first_step_differs_from_the_next_only_by_ctcs_integer_saves_under_the_watcher():
    """Wav2Vec2ForCTC in training (time masking on), seeded alike before each step: from the second step on every
    pass records the same saves. The first, watched by a dispatch mode, differs only where torch's own CTC loss does
    under any dispatch mode (docs/levels.md#limits): it saves the input and target lengths as int64 tensors, and divides
    its mean by the int64 target lengths where it otherwise divides by a float copy of them. Three int64 tensors of
    ``batch`` elements in place of one float32 one: 20 bytes a sample more, none of them compressed, and every
    compressed save the same."""
    from collections import Counter

    np = pytest.importorskip("numpy")
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.05, mask_time_length=2, ctc_loss_reduction="mean",
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(config).train()
    batch = 2
    audio = torch.randn(batch, 1600, generator=_gen())
    labels = torch.randint(1, 12, (batch, 12), generator=_gen(1))

    def loss():
        torch.manual_seed(0)
        np.random.seed(0)  # transformers draws the time mask's spans with numpy
        return model(audio, labels=labels).loss

    class Passing(TorchDispatchMode):  # a dispatch mode that does nothing: what torch does under the watcher
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def nodes(mode: bool) -> list[str]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            if mode:
                with Passing():
                    loss()
            else:
                loss()
        names = [type(t.grad_fn).__name__ for t in saved if t.grad_fn is not None]
        return [name for name in names if name.startswith("CtcLoss")]

    assert nodes(False) == ["CtcLossBackward0"] and nodes(True) == ["CtcLossBackward1"]  # torch's, with no gactx

    def fates(records) -> list[tuple]:
        """Each record as a fate: the key without its index in the model's own call, where the extra saves shift
        the later ones."""
        return [
            (r.key.module, r.key.call, r.key.index if r.key.module else None, r.key.shape, r.dtype, r.op, r.cls,
             r.bits, r.reason, r.original_bytes, r.packed_bytes)
            for r in records
        ]  # fmt: skip

    passes = []
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss().backward()
            passes.append((fates(controller.records), controller.memory_stats()))
            controller.iterate()
    (first, first_stats), (second, second_stats), (third, third_stats) = passes
    assert second == third and second_stats == third_stats

    def apart(a: list, b: list) -> list[tuple]:  # the fates of a that b lacks: (module, shape, dtype, reason, n)
        return [(f[0], f[3], f[4], f[8], n) for f, n in (Counter(a) - Counter(b)).items()]

    assert apart(first, second) == [("", (batch,), torch.int64, "dtype int64", 3)]  # the model's own call: the loss
    assert apart(second, first) == [("", (batch,), torch.float32, "small", 1)]
    assert len(first) == len(second) + 2
    assert first_stats.original_bytes == second_stats.original_bytes + 20 * batch
    compressed = [f for f in first if f[7] is not None]
    assert compressed and compressed == [f for f in second if f[7] is not None]
    assert first_stats.packed_bytes - 20 * batch == second_stats.packed_bytes
