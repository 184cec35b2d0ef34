"""Tensors probed in groups (gactx/controller/adaptation/groups.py) and their use by GACT's estimator."""

import functools
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gactx
from benchmarks.zoo import build
from gactx.controller.adaptation import groups
from gactx.controller.adaptation.groups import form_groups, solve
from gactx.controller.adaptation.sensitivity import NEGLIGIBLE
from tests.helpers import gradient_error, on_two_ranks


def _profile(*weights: float) -> torch.Tensor:
    return torch.tensor(weights, dtype=torch.float64)


def test_tensors_whose_noise_lands_apart_go_in_one_group():
    expected = {"a": _profile(4, 0, 0, 1), "b": _profile(0, 3, 0, 0), "c": _profile(0, 0, 2, 0)}
    assert form_groups(expected) == [["a", "b", "c"]]


def test_tensors_whose_noise_lands_in_the_same_parameters_stay_apart():
    # b keeps 0.5 of what it puts in the gradient to itself next to a: less than PURITY
    expected = {"a": _profile(1, 1, 0), "b": _profile(1, 1, 0), "c": _profile(0, 0, 5)}
    assert sorted(map(sorted, form_groups(expected))) == [["a", "c"], ["b"]]
    assert sorted(map(sorted, form_groups(expected, purity=0.5))) == [["a", "b", "c"]]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6),
    st.lists(st.floats(0.2, 5.0), min_size=6, max_size=6),
    st.floats(0.0, 0.3),
)
def test_a_group_pass_gives_back_each_members_scale(sizes, scales, leak):
    """Each member puts most of its noise in a parameter of its own and ``leak`` of it in one that all share; a pass
    whose squared distances are the scaled sum gives every scale back."""
    n = len(sizes)
    expected = []
    for i, size in enumerate(sizes):
        row = torch.zeros(n + 1, dtype=torch.float64)
        row[i], row[n] = size * (1 - leak), size * leak
        expected.append(row)
    measured = sum(k * row for k, row in zip(scales, expected, strict=False))
    found = solve(expected, measured)
    assert found is not None
    assert torch.allclose(torch.tensor(found, dtype=torch.float64), torch.tensor(scales[:n], dtype=torch.float64))


def test_a_pass_that_lands_where_no_member_is_expected_or_needs_a_negative_scale_is_not_trusted():
    expected = [_profile(1, 0, 0), _profile(0, 1, 0)]
    assert solve(expected, _profile(1, 1, 1)) is None  # a third of it where no member reaches
    assert solve(expected, _profile(1, 1, 0.01)) is not None
    assert solve([_profile(1, 1), _profile(1, 0)], _profile(0.2, 2)) is None  # the second member's scale below 0
    # both scales positive, but the first member then holds most of what the second reaches: its purity is gone
    assert solve([_profile(1, 0.2, 0), _profile(0, 1, 1)], _profile(10, 2.1, 0.1)) is None
    assert solve(expected, _profile(0, 0, 0)) is None


def _later_adaptation(grouped: bool, seed: int, monkeypatch) -> tuple[dict, int, int]:
    """The zoo BERT's sensitivities after an adaptation that follows the first (which probes each tensor alone, so
    that both start from one allocation), its passes and the closure's calls."""
    monkeypatch.setattr(groups, "GROUPED", False)
    model, run = build("bert")
    calls = []

    def backprop():
        calls.append(1)
        torch.manual_seed(0)
        run().backward()

    from gactx.controller.adaptation import replayed

    monkeypatch.setattr(replayed, "REPLAY", False)  # every pass runs the closure: the passes counted are its calls
    controller = gactx.Controller(model, "L2.2", seed=seed)
    with controller:
        backprop()
        controller.iterate(backprop)
        calls.clear()
        monkeypatch.setattr(groups, "GROUPED", grouped)
        later = controller.adapt(backprop)
    return dict(controller.sensitivity), later.passes, len(calls)


def _spread(a: dict, b: dict) -> float:
    """The standard deviation of the log ratios of two estimates' sensitivities."""
    return statistics.pstdev(math.log(a[s] / b[s]) for s in a if a[s] > 0 and b[s] > 0)


def test_a_later_adaptation_probes_tensors_whose_noise_lands_apart_in_one_pass(monkeypatch):
    """An adaptation after the first probes the tensors it probed alone last time, whose noise lands in parameters
    few others' does, several in the same passes, each drawn as it would be alone: on the zoo BERT 23 passes become 12,
    the passes counted are those run, and the sensitivities differ from the passes alone by less than two estimates
    alone with other seeds differ (0.16 against 0.76 in log ratio, standard deviation)."""
    alone, more, _ = _later_adaptation(False, 0, monkeypatch)
    other, _, _ = _later_adaptation(False, 1, monkeypatch)
    together, fewer, calls = _later_adaptation(True, 0, monkeypatch)
    assert fewer == calls and fewer <= more - 5
    assert sorted(alone) == sorted(together) and _spread(together, alone) < _spread(other, alone)


def _first_adaptation(name: str, grouped: bool, monkeypatch) -> tuple[int, float]:
    """The passes of a zoo model's first adaptation, and the gradient error of 4 draws at the allocation it made."""
    monkeypatch.setattr(groups, "GROUPED", grouped)
    model, run = build(name)

    def loss():
        torch.manual_seed(0)  # the same dropout masks in every pass
        return run()

    controller = gactx.Controller(model, "L2.2", seed=0)
    with controller:
        loss().backward()
        controller.iterate(lambda: loss().backward())
    return controller.last_adaptation.passes, gradient_error(model, loss, controller, draws=4)


@pytest.mark.parametrize("name", ["transformer_layer", "bert", "resnet"])
def test_a_first_adaptation_in_groups_holds_the_gradient_error_for_fewer_passes(name, monkeypatch):
    """The first adaptation measures in groups the tensors whose profiles it measured before (a curve's second width,
    expected from its first; the sketches' calibration after the tensors' own passes; by two estimates, the second's
    tensors; the zoo ResNet's BatchNorm inputs: 8 passes for their 10 curve widths): fewer passes,
    the gradient error at the allocation it makes within 10% of measuring each alone. On the zoo BERT, whose first
    adaptation against the exact base groups nothing (one estimate, each tensor's first measurement alone), the
    estimate of the other tensors at their widths (``sensitivity.EXACT_BASE`` off: two estimates)."""
    if name == "bert":
        from gactx.controller.adaptation import sensitivity

        monkeypatch.setattr(sensitivity, "EXACT_BASE", False)
    more, before = _first_adaptation(name, False, monkeypatch)
    fewer, after = _first_adaptation(name, True, monkeypatch)
    assert fewer < more and after <= 1.1 * before


def _ranked(rank: int, negligible: float) -> dict:
    """A zoo BERT whose weights differ on each of two ranks: its first and a later adaptation, with
    ``sensitivity.NEGLIGIBLE`` at ``negligible``."""
    from gactx.controller.adaptation import groups as grouping
    from gactx.controller.adaptation import sensitivity

    sensitivity.NEGLIGIBLE = negligible  # this process's own

    largest, seen = [], []
    form = grouping.form_groups

    def spy(expected, purity=None):
        found = form(expected, purity)
        largest.append(max((len(g) for g in found), default=0))
        seen.append(sorted((repr(s), float(e.sum())) for s, e in expected.items()))
        return found

    grouping.form_groups = spy
    model, run = build("bert")
    with torch.no_grad():  # each rank's own weights: its own gradients, sensitivities and profiles
        gen = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen) * p.std().nan_to_num())

    def backprop():
        torch.manual_seed(0)
        run().backward()

    controller = gactx.Controller(model, "L2.2", seed=0)
    with controller:
        backprop()
        controller.iterate(backprop)
        first = controller.last_adaptation.passes
        later = controller.adapt(backprop).passes
    return {
        "passes": [first, later],
        "largest group": max(largest, default=0),
        "expected": seen,  # what each tensor was expected to put in the gradient, at each grouping
        "bits": sorted((repr(k), v) for k, v in controller.allocation.items()),
        "sensitivity": sorted((repr(k), v) for k, v in controller.sensitivity.items()),
    }


@pytest.mark.parametrize("negligible", [0.0, NEGLIGIBLE], ids=["each grouped", "negligible ones together"])
def test_ranks_with_other_data_group_alike_and_run_as_many_passes(negligible, tmp_path):
    """Under torch.distributed each rank must run as many passes of the closure as the others (DDP's and FSDP's
    backward wait on collectives): what each pass measures, and what each tensor is expected to put in the gradient,
    are averaged over the ranks before they are read, so that two gloo processes whose weights differ group, solve and
    split alike from the same numbers, and allocate alike (tests/controller/test_ddp.py trains DDP so); so do they
    choose the negligible tensors measured together in one pass."""
    r0, r1 = on_two_ranks(functools.partial(_ranked, negligible=negligible), tmp_path)
    assert r0["expected"] == r1["expected"] and len(r0["expected"]) >= 2
    assert r0["passes"] == r1["passes"] and r0["largest group"] == r1["largest group"] >= (2 if not negligible else 1)
    assert r0["bits"] == r1["bits"] and r0["sensitivity"] == r1["sensitivity"]


_ROTATED = groups.Passes._rotated  # as the package defines it (a test's spy wraps this one, not another test's)


def _stacked_batch_norms(
    rotate: bool, monkeypatch, rotations: int = 1, later: int = 4
) -> tuple[list[int], list[set], list[dict], dict, float]:
    """Eight ``Linear`` + ``BatchNorm1d`` + ReLU blocks, whose BatchNorm inputs' noise lands mostly in the first
    weights (no group takes them): ``later`` adaptations after the first, with :data:`groups.ROTATE` at ``rotate`` and
    :data:`groups.ROTATIONS` at ``rotations``. Their passes, the tensors each measured together (rotated), what its
    profiles say it rotated (slot -> estimates in a row), the allocation and the gradient error at it."""
    monkeypatch.setattr(groups, "ROTATE", rotate)
    monkeypatch.setattr(groups, "ROTATIONS", rotations)
    rotated = []

    def spy(self, row, joint, expected, reference):
        found = _ROTATED(self, row, joint, expected, reference)
        rotated.append(set(found))
        return found

    monkeypatch.setattr(groups.Passes, "_rotated", spy)
    torch.manual_seed(0)
    blocks = [m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 4))
    x, y = torch.randn(64, 64), torch.randint(0, 4, (64,))

    def loss():
        return torch.nn.functional.cross_entropy(model(x), y)

    passes, kept = [], []
    controller = gactx.Controller(model, "L2.2", seed=0)
    with controller:
        loss().backward()
        controller.adapt(lambda: loss().backward())
        for _ in range(later):
            passes.append(controller.adapt(lambda: loss().backward()).passes)
            kept.append(dict(controller.estimator._profiles.rotated))
    return passes, rotated, kept, dict(controller.allocation), gradient_error(model, loss, controller, draws=4)


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
    """With :data:`groups.ROTATIONS` at 2, up to two thirds of the BatchNorm inputs no group takes are measured
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
    tensors' median ratio 1: what :meth:`groups.Passes._rotated` found, the slots of each pass it ran, and the passes
    the progress's total counts for them after it, those of the members left to be measured alone included (one pass
    was planned)."""
    monkeypatch.setattr(groups, "HALVES", halves)
    passes = groups.Passes(lambda: [], lambda probes: None, (1,), None)
    ran = []

    def run(first, second):
        ran.append(set(first))
        return torch.tensor([float(sum(true[s] for s in first))], dtype=torch.float64)

    passes.run = run
    row = {s: (s, None, 1.0) for s in true}
    expected = {s: _profile(1.0) for s in true}
    before = passes.total
    found = passes._rotated(row, list(true), expected, 1.0)
    return found, ran, passes.total - before + 1


def test_a_rotation_not_borne_out_is_measured_again_in_halves(monkeypatch):
    """Eight tensors measured together where one of them grew 30-fold since its last measurement: the pass is refused
    (its ratio 4.6 against the others' 1), so is the half that holds it, and so on down, while each half without it is
    borne out at its members' own scale. Five passes where each alone after the first took eight more, the one that
    grew measured alone; each member found is scaled by what its own half measured; the progress counts what ran."""
    true = {f"t{i}": 1.0 for i in range(8)} | {"t5": 30.0}
    found, ran, counted = _rotation(true, monkeypatch, halves=4)
    assert ran == [set(true), {"t0", "t1", "t2", "t3"}, {"t4", "t5", "t6", "t7"}, {"t4", "t5"}, {"t6", "t7"}]
    assert found == {s: 1.0 for s in ("t0", "t1", "t2", "t3", "t6", "t7")}  # t4 and t5 are left to be measured alone
    assert counted == len(ran) + 2  # and t4 and t5 alone
    none, ran_alone, counted_alone = _rotation(true, monkeypatch, halves=0)
    assert none == {} and ran_alone == [set(true)] and counted_alone == 1 + 8
