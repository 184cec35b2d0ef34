"""gactx/controller/replay.py: a save done again in a later pass stores, records and returns what the whole pack path
would, and is dropped when what it was decided under changes."""

from unittest import mock

import pytest
import torch
from torch import nn

import gactx
from gactx.controller import replay
from gactx.kernels import cpu


class Mixed(nn.Module):
    """Saves of every replayed kind: linear inputs (codes), GELU's (FewBit codes), a ReLU and a tanh result (a mask, a
    result save), a dropout mask, a norm's input, one input saved by two layers (shared), and a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(64, 64) for _ in range(3))
        self.norm, self.drop = nn.LayerNorm(64), nn.Dropout(0.25)

    def forward(self, x):
        h = nn.functional.gelu(self.a(x))
        h = self.norm(torch.relu(h) + self.drop(torch.tanh(h)))
        return (self.b(h) * self.c(h)).t() @ h[:, :8]


def _passes(model, x, level="L1", passes=4, **options):
    """Gradients, records and memory statistics of each of ``passes`` identical steps under one controller (the
    step is not advanced: every pass draws the same noise)."""
    out = []
    with gactx.Controller(model, level=level, **options) as controller:
        for _ in range(passes):
            torch.manual_seed(1)  # the dropout mask
            model(x).sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            records = [(r.key, r.dtype, r.bits, r.original_bytes, r.packed_bytes, r.op, r.cls, r.reason, r.storage)
                       for r in controller.records]  # fmt: skip
            out.append((grads, records, controller.memory_stats(), controller.diagnostics()))
    return out


@pytest.mark.parametrize("level", ["L1", "L1.1", "L2"])
def test_a_replayed_pass_stores_and_records_what_the_whole_path_did(level):
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(64, 64)
    passes = _passes(model, x, level)
    assert passes[1][3]["replays"] > 0, "the first unwatched pass leaves replays"
    whole, replayed = passes[1], passes[3]
    for g, h in zip(whole[0], replayed[0], strict=True):
        assert torch.equal(g, h)
    assert whole[1] == replayed[1]
    assert whole[2] == replayed[2]
    assert replayed[2].deduplicated > 0, "the shared input is stored once"


class Held(nn.Module):
    """Saves whose storage an earlier save of the pass holds in another form: an in-place ReLU's mask of what a
    convolution and a linear layer then save as their inputs, and another linear layer's input, a strided view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.relu = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True)
        self.fc, self.fc2 = nn.Linear(8 * 8 * 8, 16), nn.Linear(8 * 8 * 4, 16)

    def forward(self, x):
        h = self.relu(self.norm(self.conv(x)))
        h = self.relu(self.conv2(h)).flatten(1)
        return self.fc(h) * self.fc2(h[:, ::2])


@pytest.mark.parametrize("level", ["L1", "L1.1"])
def test_a_save_of_a_storage_held_in_another_form_is_replayed_as_the_whole_path_stored_it(level, monkeypatch):
    """A convolution's input that a ReLU saved first as a mask: replayed from the second unwatched pass on, with the
    gradients, records and memory statistics of the whole path; the storage counted once."""
    from gactx.controller.pack import PackPath

    torch.manual_seed(0)
    model, x = Held(), torch.randn(16, 4, 8, 8)
    whole_path = []
    finish = PackPath._finish

    def counted(self, t, *args, **kwargs):
        whole_path.append(t.dtype)
        return finish(self, t, *args, **kwargs)

    monkeypatch.setattr(PackPath, "_finish", counted)
    with gactx.Controller(model, level=level):
        for _ in range(4):
            whole_path.clear()
            model(x).sum().backward()
    assert whole_path == [], "the last pass stored every save by its replay"
    passes = _passes(model, x, level)
    whole, replayed = passes[1], passes[3]
    for g, h in zip(whole[0], replayed[0], strict=True):
        assert torch.equal(g, h)
    assert whole[1] == replayed[1]
    assert whole[2] == replayed[2]
    inputs = [r for r in replayed[1] if r[5].startswith(("convolution:input", "addmm:mat1")) and r[8]]
    shared = [r for r in replayed[1] if r[5].startswith("relu") and any(r[8] == i[8] for i in inputs)]
    assert len(inputs) >= 3 and shared, "the inputs share their storage's number with the ReLU's mask"


def test_a_save_whose_dtype_changed_goes_the_whole_path():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), torch.randn(64, 64)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            model(x).sum().backward()
        model.to(torch.bfloat16)
        model(x.to(torch.bfloat16)).sum().backward()
        dtypes = {r.dtype for r in controller.records if r.compressed}
    assert dtypes == {torch.bfloat16}
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())


def test_a_new_allocation_drops_the_replays_made_under_the_old_one():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), torch.randn(64, 64)
    controller = gactx.Controller(model, level="L2")
    with controller:
        for _ in range(3):
            model(x).sum().backward()
        assert controller.diagnostics()["replays"] > 0
        controller.adapt(lambda: model(x).sum().backward())
        assert controller.diagnostics()["replays"] == 0
        allocation = controller.allocation
        model(x).sum().backward()
        model(x).sum().backward()  # replayed under the new allocation
        widths = {r.key.slot: r.bits for r in controller.records if r.allocated}
    assert widths and all(widths[slot] == allocation[slot] for slot in widths)


def _handles(model, x, level, passes=4):
    """The types of what the pack hook returned in the last of ``passes`` identical passes, and its gradients."""
    from gactx.controller.pack import PackPath

    returned, pack = [], PackPath.pack
    with mock.patch.object(PackPath, "pack", lambda path, t: returned.append(pack(path, t)) or returned[-1]):
        with gactx.Controller(model, level=level):
            for _ in range(passes):
                returned.clear()
                torch.manual_seed(1)
                model(x).sum().backward()
                grads = [p.grad.clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
    return [type(h).__name__ for h in returned], grads


@pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")
@pytest.mark.parametrize("level", ["L1", "L1.1"])
def test_replayed_saves_return_native_handles_with_the_gradients_of_python_ones(level, monkeypatch):
    """On a CPU a replayed save of codes or FewBit codes is stored and decoded by one C++ call each way: the same
    bytes, so the same gradients as the Python handle of the same replay; a save that a later one shares keeps a
    Python handle (the dedupe table reads its fields)."""
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(64, 64)
    native, grads = _handles(model, x, level)
    assert native.count("Saved") >= 4, native  # three linear inputs but the shared one, GELU's input
    assert "Packed" in native, "the input two layers save stays a Python handle"
    monkeypatch.setattr(replay, "_native", lambda *args: None)
    python, python_grads = _handles(model, x, level)
    assert "Saved" not in python and len(python) == len(native)
    for g, h in zip(grads, python_grads, strict=True):
        assert torch.equal(g, h)


@pytest.mark.parametrize("change", ["relu output", "gelu input"])
def test_a_replayed_save_changed_in_place_raises_as_autograd_does(change):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(128, 64)

    def step():
        h = model[1](model[0](x))
        g = model[2](h)
        out = model[4](model[3](g))
        return out.sum(), {"relu output": h, "gelu input": g}[change]

    loss, changed = step()
    with torch.no_grad():
        changed.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        loss.backward()
    with gactx.Controller(model, level="L1", min_numel=0):
        for _ in range(3):
            step()[0].backward()
        loss, changed = step()
    with torch.no_grad():
        changed.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
        loss.backward()
    assert str(ours.value).split(":")[0] == str(plain.value).split(":")[0]
    assert "is at version 1; expected version 0 instead" in str(ours.value)
