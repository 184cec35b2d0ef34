"""gactx.Plan: the one value the hooks store each save by, replaced by the controller and never changed."""

import dataclasses

import pytest
import torch
from torch import nn

import gactx
from gactx.controller.adaptation import default_width
from gactx.controller.adaptation.sensitivity import Probe


def test_a_fixed_level_gives_its_width_and_no_choice():
    plan = gactx.Plan.initial(4, adaptive=False, seed=0)
    assert plan.width(("fc", 1, 0)) == (4, None, False)
    assert plan.compiled_width(["fc"], (8, 8), torch.float32) == 4


def test_an_adaptive_level_gives_the_allocation_else_the_default_width():
    choice = gactx.Choice(2, "samples", 0.25, 4)
    plan = gactx.Plan.initial(2, adaptive=True, seed=0).allocated({("a", 1, 0): 8}, {("b", 1, 0): choice})
    assert plan.width(("a", 1, 0)) == (8, None, False)
    assert plan.width(("b", 1, 0)) == (default_width(2), choice, False)
    assert plan.width(("c", 1, 0)) == (default_width(2), None, False)


def test_a_probe_overrides_its_slot_only():
    probe = Probe(("a", 1, 0), 1, 1234)
    plan = gactx.Plan.initial(4, adaptive=True, seed=0).allocated({("a", 1, 0): 8}, {}).probing(probe)
    assert plan.width(("a", 1, 0)) == (1, None, True) and plan.seed(("a", 1, 0), 0) == 1234
    assert plan.width(("b", 1, 0)) == (default_width(4), None, False) and plan.seed(("b", 1, 0), 0) != 1234
    assert plan.probing(None).width(("a", 1, 0)) == (8, None, False)


def test_seeds_are_distinct_by_key_and_change_with_the_step_and_the_seed():
    plan = gactx.Plan.initial(4, adaptive=False, seed=0)
    seeds = {plan.seed(("x", 1, 0), k) for k in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**62 for s in seeds)
    assert plan.at_step(1, 0).seed(("x", 1, 0), 0) != plan.seed(("x", 1, 0), 0)
    assert plan.at_step(1, 7).seed(("x", 1, 0), 0) != plan.at_step(1, 0).seed(("x", 1, 0), 0)
    assert plan.at_step(3, 0).seed(("x", 1, 0), 5) == plan.at_step(3, 0).seed(("x", 1, 0), 5)


def test_compiled_widths_come_from_the_eager_saves_of_the_same_module_shape_and_dtype():
    compiled = (("block.fc", (8, 8), torch.float32, 8), ("block.fc", (8, 8), torch.float32, 2),
                ("other", (8, 8), torch.float32, 4))  # fmt: skip
    plan = gactx.Plan.initial(2, adaptive=True, seed=0).allocated({("block.fc", 1, 0): 8}, {}, compiled)
    assert plan.compiled_width(["fc"], (8, 8), torch.float32) == 8  # the widest, by the region's relative name
    assert plan.compiled_width(["fc"], (4, 8), torch.float32) == default_width(2)
    assert plan.compiled_width(["fc"], (8, 8), torch.bfloat16) == default_width(2)


def test_a_plan_cannot_be_changed_in_place():
    plan = gactx.Plan.initial(2, adaptive=True, seed=0).allocated({("a", 1, 0): 8}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.bits = 4
    with pytest.raises(TypeError):
        plan.allocation[("a", 1, 0)] = 2


def test_the_controller_replaces_its_plan_as_training_goes_on():
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(16, 32)
    controller = gactx.Controller(model, level="L2.2", adapt_interval=10**9)

    def backprop():
        model.zero_grad()
        model(x).pow(2).mean().backward()

    with controller:
        first = controller.plan
        backprop()
        controller.iterate(backprop)  # step 1: an adaptation
        adapted = controller.plan
        assert adapted is not first and first.step == 0 and not first.allocation
        assert adapted.step == controller.step == 1 and dict(adapted.allocation) == controller.allocation
        assert adapted.probe is None  # the estimator's probes are gone once it is done
        backprop()
        controller.iterate(backprop)
        assert controller.plan.step == 2 and controller.plan.allocation == adapted.allocation
        assert controller.plan.seed_base != adapted.seed_base and adapted.step == 1
    state = controller.state_dict()
    resumed = gactx.Controller(model, level="L2.2")
    resumed.load_state_dict(state)
    assert resumed.plan.step == 2 and resumed.plan.allocation == controller.plan.allocation
    assert resumed.plan.seed_base == controller.plan.seed_base
