"""gactx/controller/adaptation/rows.py: an embedding table's gradient in a pass from the probed nodes, as its rows."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gactx
from gactx.controller.adaptation import replayed, rows


class Tagger(nn.Module):
    """Four embedding tables: one with a padding row and gradients scaled by frequency, a plain one, one whose weight
    the output layer shares, and one whose weight has a hook; a normalisation and an MLP above their sum. The sum may
    be computed inside a non-reentrant checkpoint."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.words = nn.Embedding(500, 16, padding_idx=0, scale_grad_by_freq=True)
        self.tags = nn.Embedding(200, 16)
        self.tied = nn.Embedding(300, 16)
        self.hooked = nn.Embedding(50, 16)
        self.hooked.weight.register_hook(lambda g: 0.5 * g)
        self.mix = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.out = nn.Linear(16, 300)
        self.out.weight = self.tied.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.words(ids[..., 0]) + self.tags(ids[..., 1]) + self.tied(ids[..., 2]) + self.hooked(ids[..., 3])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.embed, ids, use_reentrant=False) if self.checkpointed else self.embed(ids)
        return self.out(self.mix(x))


def _batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, high, (n, 12), generator=gen) for high in (40, 20, 300, 50)], dim=-1)
    ids[:, -3:, 0] = 0  # padding at the end of every sequence; 40 of 500 words: each read many times
    return ids, torch.randint(0, 300, (n, 12), generator=gen)


def test_only_an_embeddings_own_untouched_weight_is_read_as_its_rows():
    """Of the four tables, the padded one and the plain one are read as rows; the weight the output layer shares and
    the one with a hook keep their dense gradients. Each one's rows have its dense gradient's squared norm."""
    torch.manual_seed(0)
    model = Tagger()
    ids, _ = _batch()
    out = model(ids)
    params = [p for p in model.parameters()]
    found = rows.tables([out.grad_fn], params)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names[i] for i in found) == ["tags.weight", "words.weight"]
    given = torch.randn_like(out)
    for i, table in found.items():
        (dense,) = torch.autograd.grad(out, [params[i]], given, retain_graph=True)
        (at_node,) = torch.autograd.grad(out, [table.edge], given, retain_graph=True)
        compact = table.of(at_node)
        assert compact.shape[0] < dense.shape[0]
        assert float(compact.square().sum()) == pytest.approx(float(dense.square().sum()), rel=1e-6)
    assert found[names.index("words.weight")].scale is not None  # the padding row and the frequencies


@pytest.mark.parametrize("checkpointed", [False, True])
def test_an_estimate_reads_the_tables_as_rows_and_measures_what_the_dense_gradients_measure(checkpointed, monkeypatch):
    """An adaptation of the tagger with the tables read as rows (``replayed.ROWS``) and with their dense gradients:
    the same sensitivities up to rounding and the same allocation, its passes from the probed nodes, those that reach
    the tables reading them as rows; with the tables' sum inside a non-reentrant checkpoint too (its saves read
    outside a backward by the pass that finds the tables)."""
    ids, target = _batch()
    read = []
    of = rows.Rows.of
    monkeypatch.setattr(rows.Rows, "of", lambda self, given: read.append(given is not None) or of(self, given))
    results = []
    for on in (False, True):
        monkeypatch.setattr(replayed, "ROWS", on)
        torch.manual_seed(0)
        model = Tagger(checkpointed)

        def backprop(model=model):
            F.cross_entropy(model(ids[:16]).flatten(0, 1), target[:16].flatten()).backward()

        with gactx.Controller(model, "L2.2", seed=0) as controller:
            F.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
            adaptation = controller.adapt(backprop)
        results.append((dict(controller.sensitivity), dict(controller.allocation), adaptation.partial_passes))
    (dense, dense_bits, _), (compact, compact_bits, partial) = results
    assert len(dense) >= 3 and partial > 0 and sum(read) >= 2  # passes that reached the tables
    assert compact_bits == dense_bits and compact == pytest.approx(dense, rel=1e-5)
