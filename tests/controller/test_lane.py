"""gactx/controller/lane.py: the C++ lane takes the replayed saves of passes by position with no Python call into the
pack path, and leaves everything as the Python path leaves it: records, statistics, keys, divergences and gradients bit
for bit, on models whose saves the lane takes, and on those whose saves it hands on (views, masks, checkpoints, a pass
that changes)."""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gactx
from gactx.controller import identity, lane
from gactx.controller.pack import PackPath
from gactx.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ kernels could not be built")
# Before Python 3.11 the hooks are the Python path's, which the tests comparing both paths then compare with itself.
LANE = lane.PYTHON_HAS_LANE
needs_lane = pytest.mark.skipif(not LANE, reason="the C++ lane needs Python 3.11 or later")


class TwoBranch(nn.Module):
    """tanh's output saved by tanh (a result: its node claimed) and by the next linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 48)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h).relu()


class Heads(nn.Module):
    """Views of results (heads split and transposed), a softmax, a reshape: saves the lane hands on."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).view(8, 16, 3, 4, 8).unbind(2)
        att = torch.softmax(q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / 8**0.5, dim=-1)
        return self.out((att @ v.transpose(1, 2)).transpose(1, 2).reshape(8, 16, 32)).square()


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(40, 40), nn.GELU()), nn.Linear(40, 40)

    def forward(self, x):
        return self.b(checkpoint(self.a, x, use_reentrant=False)).sigmoid()


MODELS = {
    "mlp": (lambda: nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.GELU())]), (64, 64)),
    "two-branch": (TwoBranch, (32, 48)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(512, 4)),
            (4, 3, 12, 12)),
    "heads": (Heads, (8, 16, 32)),
    "checkpointed": (Checkpointed, (16, 40)),
}  # fmt: skip


def _train(monkeypatch, name: str, native: bool, level: str = "L1", steps: int = 6, shapes=None):
    """Each step's records, statistics and gradients, and the keys' state at the end, of ``steps`` steps of a model of
    ``MODELS`` (the inputs' batch from ``shapes`` where given, one a step)."""
    monkeypatch.setattr(lane, "NATIVE", native)
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    out = []
    with gactx.Controller(model, level=level) as controller:
        for step in range(steps):
            x = torch.randn((shapes[step], *shape[1:]) if shapes else shape)
            model(x).sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            out.append((list(controller.records), controller.memory_stats(), grads))
            model.zero_grad(set_to_none=True)
            controller.iterate()
        diagnostics = controller.diagnostics()
    return out, diagnostics["keys_by_position"], diagnostics["divergences"]


def _same(a, b) -> None:
    steps_a, by_position_a, divergences_a = a
    steps_b, by_position_b, divergences_b = b
    assert (by_position_a, divergences_a) == (by_position_b, divergences_b)
    for (records_a, stats_a, grads_a), (records_b, stats_b, grads_b) in zip(steps_a, steps_b, strict=True):
        assert records_a == records_b
        assert stats_a == stats_b
        for ga, gb in zip(grads_a, grads_b, strict=True):
            assert torch.equal(ga, gb)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_lane_leaves_records_statistics_keys_and_gradients_as_the_python_path(monkeypatch, name):
    native = _train(monkeypatch, name, True)
    assert native[1], "keys go by position"
    _same(native, _train(monkeypatch, name, False))


def test_the_lane_leaves_an_adaptive_level_and_a_pass_that_changes_as_the_python_path(monkeypatch):
    _same(_train(monkeypatch, "two-branch", True, "L2"), _train(monkeypatch, "two-branch", False, "L2"))
    shapes = [32, 32, 32, 32, 16, 32, 32, 32, 32]  # by position from the third step; the fifth diverges
    native = _train(monkeypatch, "mlp", True, steps=len(shapes), shapes=shapes)
    assert native[2] == 1
    _same(native, _train(monkeypatch, "mlp", False, steps=len(shapes), shapes=shapes))


def _python_packs(monkeypatch, name: str, level: str = "L1") -> int:
    """Saves the Python pack path took in the fourth pass of a model of ``MODELS`` (keys by position from the third)."""
    calls, original = [0], PackPath.pack

    @identity.passes_saves_on
    def pack(self, t):
        calls[0] += 1
        return original(self, t)

    monkeypatch.setattr(PackPath, "pack", pack)
    make, shape = MODELS[name]
    model, x = make(), torch.randn(shape)
    with gactx.Controller(model, level=level):
        for _ in range(4):
            calls[0] = 0
            model(x).sum().backward()
    return calls[0]


@needs_lane
def test_the_lane_takes_every_save_of_a_repeated_pass_of_linear_layers_and_gelus(monkeypatch):
    assert _python_packs(monkeypatch, "mlp") == 0  # the input, the weights, the codes: none in Python
    monkeypatch.setattr(lane, "NATIVE", False)
    assert _python_packs(monkeypatch, "mlp") == 8  # each layer's input and weight (not the first's), GELU's input
    monkeypatch.setattr(lane, "NATIVE", True)
    assert _python_packs(monkeypatch, "mlp", level="L0") == 6  # its 2 weights kept; the rest (no replay at L0): Python


@needs_lane
def test_the_lane_takes_views_of_results_and_hands_on_what_it_cannot_take(monkeypatch):
    """Heads split by views: the lane judges views as policy.is_weight does and takes those replayed with a packer; it
    hands on the input's view (data that lives anyway: its own byte range) and a transpose (not contiguous)."""
    native = _python_packs(monkeypatch, "heads")
    monkeypatch.setattr(lane, "NATIVE", False)
    assert native <= 2 < _python_packs(monkeypatch, "heads")


@pytest.mark.skipif(LANE, reason="Python 3.11 and later have the lane")
def test_before_python_3_11_every_save_takes_the_python_path(monkeypatch):
    assert _python_packs(monkeypatch, "mlp") == 8  # as with lane.NATIVE false on a Python with the lane


def test_an_autocast_copy_of_a_weight_is_kept_by_the_lane_as_by_the_python_path(monkeypatch):
    """A bfloat16 autocast copy of a weight (a new storage, made by ToCopyBackward0 from the leaf) and its view are
    weights: kept with their history, no record, in both paths."""

    def run(native: bool):
        monkeypatch.setattr(lane, "NATIVE", native)
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), torch.randn(64, 64)
        out = []
        with gactx.Controller(model, level="L1") as controller:
            for _ in range(5):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().square().sum()
                loss.backward()
                out.append(([str(r.key) for r in controller.records], [p.grad.clone() for p in model.parameters()]))
                model.zero_grad(set_to_none=True)
            by_position = controller.diagnostics()["keys_by_position"]
        return out, by_position

    native, python = run(True), run(False)
    assert native[1] and python[1]
    for (keys_a, grads_a), (keys_b, grads_b) in zip(native[0], python[0], strict=True):
        assert keys_a == keys_b and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_a_weight_changed_in_place_after_its_save_raises_autograds_error():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(4):
            model(x).sum().backward()
        assert controller.diagnostics()["keys_by_position"]
        loss = model(x).sum()
        with torch.no_grad():
            model[2].weight.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_controller_with_the_lane_is_freed_with_its_model():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    controller = gactx.Controller(model, level="L1")
    with controller:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
    freed = weakref.ref(controller)
    del controller, model
    gc.collect()
    assert freed() is None
