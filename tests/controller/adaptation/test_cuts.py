"""gactx/controller/adaptation/cuts.py, and the passes that share the backward below a cut (passes.CUTS)."""

import functools

import pytest
import torch
from torch import nn

import gactx
from gactx.controller.adaptation import cuts, passes, replayed


class _Residual(nn.Module):
    """A stem (``Linear`` + BatchNorm + ReLU), one residual block of two ``Linear`` + BatchNorm, and a head; with
    ``shared``, the block's second product reuses the stem's weight (a weight above and below the block's input)."""

    def __init__(self, residual: bool = True, shared: bool = False) -> None:
        super().__init__()
        self.stem, self.stem_bn = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.a, self.a_bn = nn.Linear(16, 16), nn.BatchNorm1d(16)
        self.b, self.b_bn = nn.Linear(16, 16), nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)
        self.residual, self.shared = residual, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem_bn(self.stem(x)))
        y = torch.relu(self.a_bn(self.a(x)))
        y = self.b_bn(y @ self.stem.weight[:, :8].repeat(1, 2).T if self.shared else self.b(y))
        return self.head(torch.relu(y + x) if self.residual else torch.relu(y))


def _cuts(model: _Residual) -> dict:
    """``cuts.cuts`` of the model's backward graph, each BatchNorm's node standing for its input's slot (named by the
    module), with the positions of its cut's near and far parameters as their names."""
    readers = {}

    def hook(module, args, out, name):
        readers[name] = [out.grad_fn]

    for name in ("stem_bn", "a_bn", "b_bn"):
        getattr(model, name).register_forward_hook(functools.partial(hook, name=name))
    loss = model(torch.randn(32, 8)).square().mean()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    found = cuts.cuts([loss.grad_fn], readers, params)
    return {slot: ({names[i] for i in c.near}, {names[i] for i in c.far}, c.kind) for slot, c in found.items()}


def test_a_residual_blocks_normalisation_inputs_share_the_cut_at_its_input():
    """Both BatchNorm inputs of the block have their cut where the block's branches meet, its input: above it the
    block's weights that each one's noise reaches (the first BatchNorm's own and the product before it; the second's
    the whole block), below it the stem's. The stem's BatchNorm has none: below it lies only its product."""
    found = _cuts(_Residual())
    stem = {"stem.weight", "stem.bias", "stem_bn.weight", "stem_bn.bias"}
    assert set(found) == {"a_bn", "b_bn"}
    assert found["a_bn"][:2] == ({"a.weight", "a.bias", "a_bn.weight", "a_bn.bias"}, stem)
    assert found["b_bn"][:2] == ({"a.weight", "a.bias", "a_bn.weight", "a_bn.bias", "b.weight", "b.bias",
                                  "b_bn.weight", "b_bn.bias"}, stem)  # fmt: skip
    assert found["a_bn"][2] == found["b_bn"][2]  # one kind of node reads them


def test_no_cut_without_a_merge_or_with_a_weight_on_both_sides():
    """A chain (no residual: no node given a gradient by two) has no cut; nor has the block's second BatchNorm input
    where the product below it reuses the stem's weight (whose gradient is summed from above and below the block's
    input). The first one's noise does not reach that product: its cut stands."""
    assert _cuts(_Residual(residual=False)) == {}
    assert set(_cuts(_Residual(shared=True))) == {"a_bn"}


def _zoo_resnet(cut: bool, monkeypatch) -> tuple[dict, dict, int]:
    """The zoo's ResNet after 5 SGD steps, adapted once at L2.2 with :data:`passes.CUTS` at ``cut``: its
    sensitivities, allocation, and the backwards run below a cut."""
    from benchmarks.zoo import build

    monkeypatch.setattr(passes, "CUTS", cut)
    below = 0
    original = replayed.Replayed.below

    def spy(self, *args):
        nonlocal below
        below += 1
        return original(self, *args)

    monkeypatch.setattr(replayed.Replayed, "below", spy)
    model, run = build("resnet", 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(0)
    for _ in range(5):
        optimizer.zero_grad()
        run().backward()
        optimizer.step()
    optimizer.zero_grad()
    with gactx.Controller(model, "L2.2", seed=0) as controller:
        torch.manual_seed(0)
        run().backward()
        controller.adapt(lambda: (torch.manual_seed(0), run().backward()))
    return dict(controller.sensitivity), dict(controller.allocation), below


def test_the_normalisation_inputs_of_a_block_share_one_backward_below_its_input(monkeypatch):
    """The zoo ResNet's blocks: each block's two BatchNorm inputs take one backward below the block's input between
    them, not one each. The one whose gradient there differs most is measured as its own pass measures it (to
    rounding), the other is read on its part above the cut and that one's below, scaled (0.89x and 1.03x of its own
    pass here); the allocation is the same."""
    each, bits, none = _zoo_resnet(False, monkeypatch)
    shared, shared_bits, below = _zoo_resnet(True, monkeypatch)
    assert none == 0 and below == 2 and shared_bits == bits
    for block in ("blocks.0", "blocks.1"):
        pair = [s for s in each if s.module in (f"{block}.bn1", f"{block}.bn2")]
        ratios = sorted(shared[s] / each[s] for s in pair)
        assert len(pair) == 2 and any(r == pytest.approx(1.0, rel=1e-5) for r in ratios)
        assert all(0.75 < r < 1.33 for r in ratios)
    rest = [s for s in each if not s.module.startswith("blocks.") or not s.module.endswith(("bn1", "bn2"))]
    assert {s: shared[s] for s in rest} == pytest.approx({s: each[s] for s in rest}, rel=0.05)


def test_the_part_below_the_cut_is_the_widest_members_scaled():
    """:meth:`passes.Passes._through` with a split of three slots given: each one's part above the cut as it is, the
    part below measured for the one whose difference at the cut is largest alone, the others' its times their squared
    differences over its; a slot whose pass cannot be split is measured alone (its pass counted by ``run``, given
    here); one pass counted for each of the others."""
    counted = passes.Passes(lambda: [], lambda probes: None, (2,), None)
    above = {"a": [torch.tensor([1.0]), None], "b": [torch.tensor([2.0]), None], "c": [torch.tensor([3.0]), None]}
    at_cut = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0, 0.0]), "c": None}
    asked = []
    counted.split = lambda slot, probe: None if slot == "d" else (above[slot], at_cut[slot])
    counted.below = lambda slot, delta: (asked.append(slot), [None, torch.tensor([4.0])])[1]  # 16 below
    counted.run = lambda first, second: torch.tensor([5.0, 0.0], dtype=torch.float64)
    row = {s: (s, None, 1.0) for s in "abcd"}
    found, fresh = {}, {}
    counted._through(row, ["a", "b", "c", "d"], found, fresh)
    assert asked == ["b"]  # its squared difference at the cut 4, a's 2, c's none
    assert found == pytest.approx({"a": 1.0 + 16 * 2 / 4, "b": 4.0 + 16.0, "c": 9.0, "d": 5.0})
    assert fresh["b"].tolist() == pytest.approx([0.2, 0.8]) and counted.done == 1 + 3


def test_a_backward_below_the_cut_that_fails_leaves_each_to_be_measured_alone():
    """Where the backward below the cut cannot run (``below`` gives ``None``: it raised, and whole replays measure the
    rest), every slot of the group is measured alone, each its own pass besides the split ones spent."""
    counted = passes.Passes(lambda: [], lambda probes: None, (2,), None)
    counted.split = lambda slot, probe: ([torch.tensor([1.0]), None], torch.tensor([1.0]))
    counted.below = lambda slot, delta: None
    alone = []
    counted.run = lambda first, second: (alone.append(set(first)), torch.tensor([5.0, 1.0], dtype=torch.float64))[1]
    found, fresh = {}, {}
    counted._through({s: (s, None, 1.0) for s in "ab"}, ["a", "b"], found, fresh)
    assert alone == [{"a"}, {"b"}] and found == {"a": 6.0, "b": 6.0} and counted.done == 1 + 2
