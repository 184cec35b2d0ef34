"""gactx/controller/product.py: a save that is the product of two saves stored in the same pass is stored as that
product, costs no bytes, decodes to the product of their decodings, and falls back where the graph changes."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx
from gactx.controller import pack

WIDTH, HIDDEN = 64, 256


class Gated(nn.Module):
    """A SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; ``add`` sums the two branches instead (no product)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.add = False

    def forward(self, x):
        a, b = F.silu(self.gate(x)), self.up(x)
        return self.down(a + b if self.add else a * b)


def _model():
    torch.manual_seed(0)
    return Gated(), torch.randn(4, 32, WIDTH)


def _down_record(controller):
    (record,) = [r for r in controller.records if r.key.module == "down"]
    return record


@pytest.mark.parametrize("native", [True, False], ids=["C++ lane", "Python path"])
def test_a_gated_product_is_stored_as_the_product_of_its_factors(native):
    model, x = _model()
    held = {}
    for products in (True, False):
        with (
            mock.patch.object(pack, "PRODUCTS", products), mock.patch("gactx.controller.lane.NATIVE", native),
            gactx.Controller(model, level="L1") as controller,
        ):  # fmt: skip
            for step in range(4):  # watched, then replayed, then by position (the C++ lane's)
                model(x).sum().backward()
                model.zero_grad(set_to_none=True)
                record = _down_record(controller)
                if products:
                    assert (record.form, record.packed_bytes, record.label) == ("product", 0, ""), (step, record)
                    assert any(" product " in line for line in controller.report().splitlines() if "down" in line)
                else:
                    assert record.form == "" and record.packed_bytes > 0
                controller.iterate()
            held[products] = (controller.memory_stats().packed_bytes, record.packed_bytes)
    assert held[True][0] == held[False][0] - held[False][1]  # what the product saved is what it stored before


def test_the_product_decodes_to_the_product_of_its_factors_decodings():
    """Deterministic rounding at 8 bits: the down layer's weight gradient is ``g^T (a' * b')`` with ``a'`` and ``b'``
    the factors as stored."""
    model, x = _model()
    with gactx.Controller(model, level="L1.1", stochastic=False):
        model(x).sum().backward()
    a, b = F.silu(model.gate(x)).detach(), model.up(x).detach()
    a_, b_ = (gactx.dequantize(gactx.quantize(t, 8, stochastic=False)) for t in (a, b))
    expected = torch.ones(4 * 32, WIDTH).t() @ (a_ * b_).reshape(-1, HIDDEN)
    torch.testing.assert_close(model.down.weight.grad, expected, rtol=1e-5, atol=1e-6)
    exact = torch.ones(4 * 32, WIDTH).t() @ (a * b).reshape(-1, HIDDEN)
    assert not torch.equal(model.down.weight.grad, exact)  # it was stored, not kept


def test_the_product_is_unbiased():
    """The factors' rounding noises are independent: the mean of many draws of the down layer's gradient closes in
    on the exact one as noise alone would (32 draws: about 0.18 of one draw's error)."""
    model, x = _model()
    model(x).sum().backward()
    exact = model.down.weight.grad.clone()
    draws = []
    for seed in range(32):
        model.zero_grad(set_to_none=True)
        with gactx.Controller(model, level="L1", seed=seed) as controller:
            model(x).sum().backward()
        assert _down_record(controller).form == "product"
        draws.append(model.down.weight.grad.clone())
    one = (draws[0] - exact).norm()
    mean = (torch.stack(draws).mean(0) - exact).norm()
    assert mean < 0.3 * one, (mean / one).item()


def test_a_graph_that_changes_stores_the_save_as_before():
    model, x = _model()
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            model(x).sum().backward()
            controller.iterate()
        assert _down_record(controller).form == "product"
        model.add = True  # the same slots, no product any more
        for _ in range(2):
            model(x).sum().backward()
            record = _down_record(controller)
            assert record.form == "" and record.packed_bytes > 0
            controller.iterate()
        model.add = False
        model(x).sum().backward()
        assert _down_record(controller).form == "product"


def test_every_backward_of_one_graph_decodes_alike():
    model, x = _model()
    with gactx.Controller(model, level="L1"):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = model(x).sum()
            loss.backward(retain_graph=True)
            first = model.down.weight.grad.clone()
            model.zero_grad(set_to_none=True)
            loss.backward()
            assert torch.equal(model.down.weight.grad, first)


def test_adaptive_levels_store_the_product_themselves():
    """The allocation prices each save by its own width: there a product is stored as any save is."""
    model, x = _model()
    with gactx.Controller(model, level="L2.2") as controller:
        model(x).sum().backward()
    assert _down_record(controller).form != "product"
