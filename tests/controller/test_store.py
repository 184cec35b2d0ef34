"""What each rule stores and how it decodes (gactx/controller/store.py)."""

import math

import pytest
import torch

from gactx.controller.rules import DROPOUT, UNUSED, Site, rule_for
from gactx.controller.store import Kept, Packed, Unused, encode
from gactx.kernels.codes import CodedTensor
from gactx.kernels.fewbit import fewbit_table


def _decode(stored):
    return Packed(stored, None, torch.zeros(1), "torch").unpack()


def _encode(t, rule, bits=None):
    return encode(t, rule, bits, seed=0, group_size=256, stochastic=True, backend="torch")


def test_a_mask_decodes_to_values_on_each_side_of_the_test():
    t = torch.tensor([-2.0, -0.5, 0.0, 0.5, 2.0] * 100)
    hardtanh = rule_for(Site("hardtanh", role="self", params=(("min_val", -1.0), ("max_val", 1.0))))
    stored = _encode(t, hardtanh)
    assert isinstance(stored, CodedTensor) and stored.bits == 1
    decoded = _decode(stored)
    assert torch.equal((decoded > -1) & (decoded < 1), (t > -1) & (t < 1))
    assert set(decoded.unique().tolist()) == {-math.inf, 0.0}


def test_sign_codes_keep_zero_and_nan():
    t = torch.tensor([-3.0, 0.0, 2.0, math.nan] * 64)
    decoded = _decode(_encode(t, rule_for(Site("abs", role="self"))))
    assert torch.equal(decoded[:3], torch.tensor([-1.0, 0.0, 1.0])) and decoded[3].isnan()


def test_unused_values_keep_the_layout_and_hold_nothing():
    t = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    stored = _encode(t, UNUSED)
    assert isinstance(stored, Unused) and stored.nbytes == 0
    decoded = _decode(stored)
    assert decoded.stride() == t.stride() and decoded.shape == t.shape and not decoded.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_dropout_masks_decode_exactly(dtype, transposed):
    torch.manual_seed(0)
    mask = torch.empty(64, 67).bernoulli_(0.7).div_(0.7).to(dtype)
    mask = mask.t() if transposed else mask
    decoded = _decode(_encode(mask, DROPOUT))
    assert torch.equal(decoded, mask) and decoded.stride() == mask.stride()


def test_fewbit_codes_decode_to_the_tables_points():
    t = torch.linspace(-6, 6, 1000)
    rule = rule_for(Site("gelu", role="self", params=(("approximate", "none"),)))
    stored = _encode(t, rule, bits=2)
    table = fewbit_table("gelu", (("approximate", "none"),), 2)
    decoded = _decode(stored)
    assert set(decoded.tolist()) <= {float(torch.tensor(p)) for p in table.points}
    codes = torch.bucketize(t, torch.tensor(table.edges, dtype=torch.float32))
    assert torch.equal(decoded, torch.tensor(table.points, dtype=torch.float32)[codes])
    assert stored.nbytes == 1000 * 2 // 8 + 4 * 4


def test_kept_classes_return_the_tensor_itself():
    # A quantized class at a width that saves nothing is kept by decide, with its reason (test_decide.py).
    t = torch.randn(64, 64)
    assert _encode(t, rule_for(Site("sqrt", role="result"))) is t


def _linear_grads(x, level):
    """The weight gradient of a linear layer whose input ``x`` the caller holds, and of one whose input is
    made inside the forward (nothing holds it after the forward)."""
    import gactx

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    target = torch.randn(256, 64)
    controller = gactx.Controller(model, level=level) if level else None
    if controller:
        controller.install_hook()
    (model(x) * target).sum().backward()
    if controller:
        controller.uninstall_hook()
        assert all(r.bits == 2 for r in controller.records if r.op.startswith("addmm"))
    return model[0].weight.grad, model[1].weight.grad


def test_a_saved_tensor_still_alive_and_unchanged_is_read_where_it_lives():
    x = torch.randn(256, 64)
    full, two_bits = _linear_grads(x, None), _linear_grads(x, "L1.2")
    assert torch.equal(two_bits[0], full[0]), "the caller's batch is read as it is: exact"
    assert not torch.equal(two_bits[1], full[1]), "the first layer's output dies after the forward: decoded"


def test_a_tensor_changed_in_place_after_its_save_raises_as_autograd_does():
    x = torch.randn(256, 64)
    stored = _encode(x, rule_for(Site("addmm", role="mat1")), bits=2)
    handle = Packed(stored, None, x, "torch")
    view = Packed(stored, None, x[:, :32], "torch")
    assert torch.equal(handle.unpack(), x) and torch.equal(view.unpack(), x[:, :32])
    x.mul_(2)
    for h in (handle, view):  # a view shares its base's version counter
        with pytest.raises(RuntimeError, match="modified by an inplace operation: .* at version 1; expected version 0"):
            h.unpack()
    y = torch.randn(256, 64)
    handle = Packed(_encode(y, rule_for(Site("addmm", role="mat1")), bits=2), None, y, "torch")
    y.data = torch.zeros(256, 64)  # another storage, the version counter untouched: the save is decoded
    assert not torch.equal(handle.unpack(), y)
    z = torch.randn(64)
    kept = Kept(z.detach(), z._version)
    assert kept.unpack() is kept.tensor
    z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        kept.unpack()


@pytest.mark.parametrize("level", ["L0", "L1.1", "L1.2"])
@pytest.mark.parametrize("change", ["input", "relu output", "weight"])
def test_in_place_changes_before_backward_raise_at_every_level_as_without_gactx(level, change):
    import gactx

    def step(with_gactx: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        x = torch.randn(128, 64)
        controller = gactx.Controller(model, level=level, min_numel=0).install_hook() if with_gactx else None
        h = model[1](model[0](x))
        out = model[2](h)
        if controller is not None:
            controller.uninstall_hook()
        changed = {"input": x, "relu output": h, "weight": model[2].weight}[change]
        with torch.no_grad():
            changed.add_(1)
        return out.sum(), changed  # the caller holds the changed tensor

    loss, changed = step(False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        loss.backward()
    loss, changed = step(True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
        loss.backward()
    assert str(ours.value).split(":")[0] == str(plain.value).split(":")[0]


def test_a_compressed_tensor_changed_and_gone_before_backward_is_decoded_as_saved():
    """The documented limit: a compressed tensor that nothing holds any more at backward cannot be asked for its
    version (autograd keeps the counter; a hook can keep only the tensor, which is what compression frees),
    so a change made to it before it went is not seen: backward uses the values it had when saved."""
    import gactx

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    with gactx.Controller(lin, level="L1.1", min_numel=0):
        h = torch.randn(128, 64) * 1.0
        out = lin(h)
    with torch.no_grad():
        h.add_(1)
    del h
    out.sum().backward()  # plain PyTorch would raise here
    assert torch.isfinite(lin.weight.grad).all()
