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
from gactx.controller.adaptation import passes
from gactx.controller.adaptation.groups import FLOOR, Weights, form_groups, parts, solve, squares, weights
from gactx.controller.adaptation.sensitivity import NEGLIGIBLE
from tests.helpers import gradient_error, on_two_ranks


def _profile(*weights: float) -> torch.Tensor:
    return torch.tensor(weights, dtype=torch.float64)


def test_each_parameters_weight_is_the_whole_gradients_mean_square_over_its_own():
    same = [torch.full((4, 4), 2.0), torch.full((8,), -2.0)]
    assert torch.allclose(weights(same), torch.ones(2, dtype=torch.float64))
    # 16 elements at 1 and 4 at 0.1 (mean square 0.01): the whole's mean square is 16.04 / 20
    w = weights([torch.ones(16), torch.full((4,), 0.1)])
    whole = 16.04 / 20
    assert torch.allclose(w, torch.tensor([whole, whole / 0.01], dtype=torch.float64))
    # a gradient of rounding errors alone (a bias a normalisation follows) is taken at FLOOR of the whole's
    w = weights([torch.ones(16), torch.full((4,), 1e-20)])
    assert float(w[1]) == pytest.approx(1 / FLOOR)
    assert torch.equal(weights([torch.zeros(3)]), torch.ones(1, dtype=torch.float64))  # no gradient: none weighed


def test_weights_come_from_the_first_gradient_and_weigh_every_squared_distance():
    a, b = [torch.ones(16), torch.full((4,), 0.1)], [torch.zeros(16), torch.zeros(4)]
    plain = parts(a, b)
    assert torch.allclose(plain, torch.tensor([16.0, 0.04], dtype=torch.float64))
    weighing = Weights()
    weighing.observe(a)
    weighing.observe(b)  # the first gradient sets them; later ones do not
    assert torch.equal(weighing.vector, weights(a))
    assert torch.allclose(parts(a, b, weighing.vector), plain * weights(a))
    assert torch.allclose(squares(a, weighing.vector), plain * weights(a))
    off = Weights(relative=False)
    off.observe(a)
    assert off.vector is None and Weights(False, weights(a)).vector is None


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
    monkeypatch.setattr(passes, "GROUPED", False)
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
        monkeypatch.setattr(passes, "GROUPED", grouped)
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
    monkeypatch.setattr(passes, "GROUPED", grouped)
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
