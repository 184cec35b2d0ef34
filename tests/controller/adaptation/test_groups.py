"""Tensors probed in groups (gactx/controller/adaptation/groups.py) and their use by GACT's estimator."""

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
from tests.helpers import gradient_error


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


@pytest.mark.parametrize("name", ["transformer_layer", "bert"])
def test_a_first_adaptation_in_groups_holds_the_gradient_error_for_fewer_passes(name, monkeypatch):
    """The first adaptation's second estimate measures in groups the tensors whose profiles the first measured, and
    each estimate the sketches' calibration pairs after the tensors' own passes: fewer passes, the gradient error at
    the allocation it makes within 10% of measuring each alone."""
    more, before = _first_adaptation(name, False, monkeypatch)
    fewer, after = _first_adaptation(name, True, monkeypatch)
    assert fewer < more and after <= 1.1 * before


def test_under_torch_distributed_every_tensor_is_measured_alone(monkeypatch):
    """Each rank's profiles are its own, and a rank that grouped otherwise would run another number of passes, which
    the collectives of DDP's or FSDP's backward cannot allow: with ranks side by side, the passes are those of
    measuring each tensor alone (the gloo processes of tests/controller/test_ddp.py run so)."""
    alone, more, _ = _later_adaptation(False, 0, monkeypatch)
    monkeypatch.setattr(groups, "_distributed", lambda: True)
    same, passes, calls = _later_adaptation(True, 0, monkeypatch)
    assert passes == calls == more and same == alone
