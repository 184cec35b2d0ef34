"""gactx/controller/adaptation/schedule.py: adaptations after the first step and every adapt_interval steps, the
interval doubling while an adaptation finds the allocation it replaces as good, back where it gains more."""

import pytest
import torch

import gactx
from gactx.controller.adaptation.allocator import Item, allocate, cost_of
from gactx.controller.adaptation.choices import Choice
from gactx.controller.adaptation.schedule import STABLE_VARIANCE, Schedule, stable
from tests.controller.adaptation.models import scaled_mlp as _mlp


def _adapted_at(schedule: Schedule, steps: int, is_stable) -> list[int]:
    out = []
    for step in range(1, steps + 1):
        if schedule.due(step):
            schedule.adapted(step, is_stable(step))
            out.append(step)
    return out


def test_a_stable_allocation_doubles_the_interval_up_to_the_backoff():
    assert _adapted_at(Schedule(1000, 8), 40_000, lambda step: step > 1) == [1, 1000, 3000, 7000, 15000, 23000, 31000,
                                                                            39000]  # fmt: skip
    assert _adapted_at(Schedule(1000, 1), 5000, lambda step: True) == [1, 1000, 2000, 3000, 4000, 5000]


def test_an_adaptation_that_gains_more_brings_the_interval_back():
    changed = {7000}
    steps = _adapted_at(Schedule(1000, 8), 12000, lambda step: step > 1 and step not in changed)
    assert steps == [1, 1000, 3000, 7000, 8000, 10000]


def test_stable_is_within_the_share_of_the_new_variance():
    assert stable(1.0, 1.0 + STABLE_VARIANCE) and not stable(1.0, 1.0 + 1.01 * STABLE_VARIANCE)
    assert not stable(1.0, None)  # the allocation before could not be kept (another tensor, over the budget)


def test_cost_of_prices_a_given_allocation_as_allocate_does():
    items = [Item(("a", 1, 0), 4096, torch.float32, 2.0), Item(("b", 1, 0), 4096, torch.float32, 0.5)]
    best = allocate(items, budget=3 * 4096 // 8 + 64)
    assert cost_of(items, best.choices) == (best.nbytes, pytest.approx(best.variance))
    swapped = {("a", 1, 0): best.choices[("b", 1, 0)], ("b", 1, 0): best.choices[("a", 1, 0)]}
    assert cost_of(items, swapped)[1] >= best.variance
    assert cost_of(items, {("a", 1, 0): Choice(2)}) is None  # no choice for b
    assert cost_of(items, {("a", 1, 0): Choice(3), ("b", 1, 0): Choice(2)}) is None  # 3 bits: not an option


def _train(controller, model, x, steps: int, between=None) -> list:
    adaptations = []
    with controller:
        for step in range(1, steps + 1):
            if between is not None:
                between(step)
            model.zero_grad()
            model(x).square().mean().backward()
            controller.iterate()
            a = controller.last_adaptation
            if a.step == step:
                adaptations.append(a)
    return adaptations


@pytest.mark.parametrize("backoff", [8, 1])
def test_the_controller_adapts_less_often_while_the_allocation_holds(backoff):
    """The same batch and weights every step: each adaptation after the first finds the allocation before it as good
    (the free estimator: read in the step before, no closure)."""
    model, x = _mlp()
    controller = gactx.Controller(model, "L2.2", estimator="actnn", adapt_interval=2, adapt_backoff=backoff)
    adaptations = _train(controller, model, x, 50)
    assert [a.stable for a in adaptations] == [False] + [True] * (len(adaptations) - 1)
    if backoff == 8:
        assert [a.step for a in adaptations] == [1, 2, 6, 14, 30, 46]
        assert [a.interval for a in adaptations] == [2, 4, 8, 16, 16, 16]
    else:
        assert [a.step for a in adaptations] == [1, *range(2, 51, 2)] and {a.interval for a in adaptations} == {2}
    assert controller.state_dict()["schedule"] == ([16, 62] if backoff == 8 else [2, 52])  # [interval, next]


def test_sensitivities_that_move_bring_the_interval_back_and_a_state_keeps_the_schedule():
    model, x = _mlp()

    def swap_scales(step: int) -> None:  # at step 12 the smallest layer becomes the largest and the other way round
        if step == 12:
            with torch.no_grad():
                model[2].weight.mul_(3000)
                model[6].weight.mul_(1 / 3000)

    controller = gactx.Controller(model, "L2.2", estimator="actnn", adapt_interval=2)
    adaptations = _train(controller, model, x, 20, swap_scales)
    assert [(a.step, a.stable, a.interval) for a in adaptations] == [
        (1, False, 2), (2, True, 4), (6, True, 8), (14, False, 2), (16, True, 4), (20, True, 8)
    ]  # fmt: skip
    resumed = gactx.Controller(model, "L2.2", estimator="actnn", adapt_interval=2)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.state_dict()["schedule"] == [8, 28]
