"""An estimate's passes (gactx/controller/adaptation/passes.py): a later estimate's rotation, and a refused one's
halves."""

import pytest
import torch

import gactx
from gactx.controller.adaptation import passes
from tests.helpers import gradient_error

_ROTATED = passes.Passes._rotated  # as the package defines it (a test's spy wraps this one, not another test's)


def _stacked_batch_norms(
    rotate: bool, monkeypatch, rotations: int = 1, later: int = 4
) -> tuple[list[int], list[set], list[dict], dict, float]:
    """Eight ``Linear`` + ``BatchNorm1d`` + ReLU blocks, whose BatchNorm inputs' noise lands mostly in the first
    weights (no group takes them): ``later`` adaptations after the first, with :data:`passes.ROTATE` at ``rotate`` and
    :data:`passes.ROTATIONS` at ``rotations``. Their passes, the tensors each measured together (rotated), what its
    profiles say it rotated (slot -> estimates in a row), the allocation and the gradient error at it."""
    monkeypatch.setattr(passes, "ROTATE", rotate)
    monkeypatch.setattr(passes, "ROTATIONS", rotations)
    rotated = []

    def spy(self, row, joint, expected, reference):
        found = _ROTATED(self, row, joint, expected, reference)
        rotated.append(set(found))
        return found

    monkeypatch.setattr(passes.Passes, "_rotated", spy)
    torch.manual_seed(0)
    blocks = [m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 4))
    x, y = torch.randn(64, 64), torch.randint(0, 4, (64,))

    def loss():
        return torch.nn.functional.cross_entropy(model(x), y)

    counts, kept = [], []
    controller = gactx.Controller(model, "L2.2", seed=0)
    with controller:
        loss().backward()
        controller.adapt(lambda: loss().backward())
        for _ in range(later):
            counts.append(controller.adapt(lambda: loss().backward()).passes)
            kept.append(dict(controller.estimator._profiles.rotated))
    return counts, rotated, kept, dict(controller.allocation), gradient_error(model, loss, controller, draws=4)


def _in_a_row(kept: list[dict]) -> list[dict]:
    """What each estimate's profiles should say of its rotated tensors: how many estimates in a row each was so."""
    out, before = [], {}
    for now in kept:
        before = {s: before.get(s, 0) + 1 for s in now}
        out.append(before)
    return out


def test_a_later_adaptation_measures_together_every_other_time_the_tensors_no_group_takes(monkeypatch):
    """Of the BatchNorm inputs that no group takes, a later adaptation measures up to half together in one pass, each
    scaled by what that pass measured, and the others alone; the next one measures those alone: no tensor is measured
    so twice in a row, none in the first later adaptation (the first one read them on their curves), the passes fall
    (7 against the base become 5 or 6), and the gradient error at the allocation is within 10% of measuring each
    alone every time (1.01x: one tensor's 4 bits went to another)."""
    each, never, _, bits, error = _stacked_batch_norms(False, monkeypatch)
    fewer, rotated, kept, rotated_bits, rotated_error = _stacked_batch_norms(True, monkeypatch)
    assert not any(never) and sum(fewer) < sum(each) and rotated_bits.keys() == bits.keys()
    assert rotated_error == pytest.approx(error, rel=0.1)
    together = [set(k) for k in kept if k]  # what each estimate's profiles say it measured together
    assert together == [r for r in rotated if r] and len(together) >= 2 and all(len(r) >= 2 for r in together)
    assert not kept[0]  # the first adaptation measured them at a curve's widths
    assert all(not a.keys() & b.keys() for a, b in zip(kept, kept[1:], strict=False))
    assert all(set(k.values()) <= {1} for k in kept)


def test_tensors_are_measured_together_at_most_rotations_estimates_in_a_row(monkeypatch):
    """With :data:`passes.ROTATIONS` at 2, up to two thirds of the BatchNorm inputs no group takes are measured
    together, none more than two estimates in a row (the profiles count them), each on its own at least every third
    estimate: fewer passes than at 1, and the gradient error at the allocation within 10% of measuring each alone
    every time."""
    each, _, _, bits, error = _stacked_batch_norms(False, monkeypatch, later=6)
    halves, by_halves, _, _, _ = _stacked_batch_norms(True, monkeypatch, rotations=1, later=6)
    fewer, rotated, kept, rotated_bits, rotated_error = _stacked_batch_norms(True, monkeypatch, rotations=2, later=6)
    assert sum(fewer) < sum(halves) < sum(each) and rotated_bits.keys() == bits.keys()
    assert rotated_error == pytest.approx(error, rel=0.1)
    assert [set(k) for k in kept if k] == [r for r in rotated if r]
    assert kept == _in_a_row(kept)  # the profiles count the estimates in a row
    assert max(n for k in kept for n in k.values()) == 2  # some twice in a row, none three times
    assert max(map(len, rotated)) > max(map(len, by_halves))  # more of them at once


def _rotation(true: dict, monkeypatch, halves: int) -> tuple[dict, list[set], int]:
    """A rotation of the slots of ``true`` (slot -> what a pass probing it measures), each expected at 1 and the other
    tensors' median ratio 1: what :meth:`passes.Passes._rotated` found, the slots of each pass it ran, and the passes
    the progress's total counts for them after it, those of the members left to be measured alone included (one pass
    was planned)."""
    monkeypatch.setattr(passes, "HALVES", halves)
    counted = passes.Passes(lambda: [], lambda probes: None, (1,), None)
    ran = []

    def run(first, second):
        ran.append(set(first))
        return torch.tensor([float(sum(true[s] for s in first))], dtype=torch.float64)

    counted.run = run
    row = {s: (s, None, 1.0) for s in true}
    expected = {s: torch.tensor([1.0], dtype=torch.float64) for s in true}
    before = counted.total
    found = counted._rotated(row, list(true), expected, 1.0)
    return found, ran, counted.total - before + 1


def test_a_rotation_not_borne_out_is_measured_again_in_halves(monkeypatch):
    """Eight tensors measured together where one of them grew 30-fold since its last measurement: the pass is refused
    (its ratio 4.6 against the others' 1), so is the half that holds it, and so on down, while each half without it is
    borne out at its members' own scale. Five passes where each alone after the first took eight more, the one that
    grew measured alone with its neighbour; the progress counts what ran."""
    true = {f"t{i}": 1.0 for i in range(8)} | {"t5": 30.0}
    found, ran, counted = _rotation(true, monkeypatch, halves=4)
    assert ran == [set(true), {"t0", "t1", "t2", "t3"}, {"t4", "t5", "t6", "t7"}, {"t4", "t5"}, {"t6", "t7"}]
    assert found == {s: 1.0 for s in ("t0", "t1", "t2", "t3", "t6", "t7")}  # t4 and t5 are left to be measured alone
    assert counted == len(ran) + 2  # and t4 and t5 alone
    none, ran_alone, counted_alone = _rotation(true, monkeypatch, halves=0)
    assert none == {} and ran_alone == [set(true)] and counted_alone == 1 + 8


def test_a_rotation_whose_halves_are_both_refused_and_disagree_measures_each_alone(monkeypatch):
    """One of the eight grew in one half, three in the other: both halves are refused, and their ratios (8.25 and
    22.75) do not bear each other out (the tensors that moved are in both): halving stops there and each is measured
    alone, two passes more than without halving, not a pass for every quarter."""
    true = {f"t{i}": 1.0 for i in range(8)} | {"t1": 30.0, "t5": 30.0, "t6": 30.0, "t7": 30.0}
    found, ran, counted = _rotation(true, monkeypatch, halves=4)
    assert ran == [set(true), {"t0", "t1", "t2", "t3"}, {"t4", "t5", "t6", "t7"}] and found == {}
    assert counted == len(ran) + 8


def test_halves_that_bear_each_other_out_are_scaled_and_measured_alone_next(monkeypatch):
    """All eight moved together, to three times what they were expected to put while the tensors measured on their
    own moved by 1: the pass is refused, and so are both halves, but at one ratio, so each half is scaled by its own
    pass (3 passes, against 9 each alone) and its tensors are unsettled, to be measured on their own in the next
    estimate. One that grew in each half (t1 and t6, 30-fold) reads so too: each half at 8.25, for one estimate."""
    true = {f"t{i}": 3.0 for i in range(8)}
    found, ran, counted = _rotation(true, monkeypatch, halves=4)
    assert found == pytest.approx({s: 3.0 for s in true}) and len(ran) == 3 and counted == 3
    movers = {f"t{i}": 1.0 for i in range(8)} | {"t1": 30.0, "t6": 30.0}
    found, ran, counted = _rotation(movers, monkeypatch, halves=4)
    assert found == pytest.approx({s: 8.25 for s in movers}) and len(ran) == 3 and counted == 3


def test_unsettled_tensors_are_measured_on_their_own_in_the_next_estimate(monkeypatch):
    """Through :meth:`passes.Passes.measure`: of eight tensors no group takes (one profile each, all in one
    parameter), a later estimate rotates five and measures three alone (each as expected); the five all moved to three
    times their expectation: refused, then scaled by their halves, and the estimate's rotation counts mark them to be
    measured on their own next time (:data:`passes.ROTATIONS`), so that the next estimate rotates none of them."""
    monkeypatch.setattr(passes, "HALVES", 2)
    slots = [f"t{i}" for i in range(8)]
    kept = passes.Profiles((0,), {s: torch.tensor([1.0], dtype=torch.float64) for s in slots},
                           dict.fromkeys(slots, 1.0), {}, frozenset(slots))  # fmt: skip
    counted = passes.Passes(lambda: [], lambda probes: None, (1,), None)
    moved = set()

    def run(first, second):
        return torch.tensor([sum(3.0 if s in moved else 1.0 for s in first)], dtype=torch.float64)

    counted.run = run
    row = {s: (s, None, 1.0) for s in slots}
    moved.update(slots[:5])  # what the rotation takes: the first five (by counts, then expectations, all equal)
    found, _ = counted.measure(row, kept, {}, {}, "against the base", negligible=1e-9)
    assert found == pytest.approx({s: 3.0 if s in moved else 1.0 for s in slots})
    assert counted.unsettled == moved and counted.rotated == dict.fromkeys(moved, passes.ROTATIONS)
    later = passes.Profiles(kept.layout, kept.shares, dict(found), dict(counted.rotated), kept.probed)
    assert not set(passes.Passes(lambda: [], lambda p: None, (1,), None)._rotation(row, found, later)) & moved
