import dataclasses

import pytest
import torch

import gactx
from gactx.config import make_config
from gactx.controller.adaptation.sensitivity import Probe
from gactx.controller.decide import BOOL_MASK, decide, kept, may_share
from gactx.controller.plan import GraphSlot
from gactx.controller.rules import (
    ATTENTION,
    CHECKPOINT_INPUT,
    EQUALITY,
    LINEAR,
    LOG,
    Site,
    graph_result_rule,
    rule_for,
)

SLOT = gactx.Slot("block", 1, 0)
X = torch.randn(4, 64)


def _plan(bits=2, **changes) -> gactx.Plan:
    return dataclasses.replace(gactx.Plan.initial(bits, False, 0), **changes)


def test_the_slot_is_the_key_without_its_shape():
    key = gactx.Key("block", 2, 3, (4, 64))
    assert key.slot == gactx.Slot("block", 2, 3) and key.slot == ("block", 2, 3)
    assert key.slot.module == "block" and key.slot.call == 2 and key.slot.index == 3


def test_a_quantized_class_gets_the_plans_width():
    config = make_config("L1.2")
    d = decide(X, LINEAR, _plan(2), SLOT, config)
    assert (d.rule, d.bits, d.choice, d.reason, d.cls) == (LINEAR, 2, None, "", "linear")


def test_attention_gets_at_least_its_floor():
    config = make_config("L1.2")
    assert decide(X, ATTENTION, _plan(2), SLOT, config).bits == 4
    assert decide(X, ATTENTION, _plan(8), SLOT, config).bits == 8


WIDTHS = [(32, torch.float32, True), (16, torch.float32, False), (16, torch.bfloat16, True), (8, torch.bfloat16, False)]


@pytest.mark.parametrize(("bits", "dtype", "as_is"), WIDTHS)
def test_a_width_that_saves_nothing_keeps_the_tensor_as_it_is(bits, dtype, as_is):
    d = decide(X.to(dtype), LINEAR, _plan(bits), SLOT, make_config("L1"))
    assert d.bits == bits and d.reason == ("as is" if as_is else "")


def test_rules_with_their_own_form_take_no_width():
    config = make_config("L1.2")
    assert decide(X, BOOL_MASK, _plan(2), SLOT, config).bits == 1
    equality = decide(X, EQUALITY, _plan(2), SLOT, config)
    assert (equality.bits, equality.reason, equality.cls) == (None, "kept", "equality")
    mask = decide(X, rule_for(Site("relu", role="result", result=True)), _plan(2), SLOT, config)
    assert (mask.bits, mask.reason, mask.cls) == (None, "", "threshold")


def test_checkpoint_inputs_take_the_levels_checkpoint_bits():
    assert decide(X, CHECKPOINT_INPUT, _plan(2), SLOT, make_config("L1", checkpoint_bits=4)).bits == 4
    off = decide(X, CHECKPOINT_INPUT, _plan(2), SLOT, make_config("L1", checkpoint_bits=None))
    assert (off.bits, off.reason) == (None, "checkpoint_bits=None")
    half = decide(X.bfloat16(), CHECKPOINT_INPUT, _plan(2), SLOT, make_config("L1", checkpoint_bits=16))
    assert (half.bits, half.reason) == (16, "as is")  # a bfloat16 boundary at 16 bits: nothing to save


def test_the_probe_quantizes_its_slot_uniformly_whatever_its_class():
    smooth = rule_for(Site("gelu", role="self"))
    plan = _plan(2, probe=Probe(SLOT, 8, 123))
    probed = decide(X, smooth, plan, SLOT, make_config("L2"))
    assert (probed.rule, probed.bits) == (LINEAR, 8)
    other = decide(X, smooth, plan, gactx.Slot("block", 1, 1), make_config("L2"))
    assert (other.rule, other.bits) == (smooth, 2)


def test_an_exact_probe_keeps_every_allocated_slot_it_does_not_probe_as_it_is():
    """``Plan.probing(..., exact=True)`` (the sensitivity estimator's passes against an exact base): the probed slot is
    quantized at the probe's width, every other save kept as it is, whatever its rule: the gradients of the pass
    differ from plain PyTorch's by the probe's noise alone."""
    smooth = rule_for(Site("gelu", role="self"))
    other = gactx.Slot("block", 1, 1)
    plan = _plan(2).probing({SLOT: Probe(SLOT, 4, 123)}, exact=True)
    probed = decide(X, smooth, plan, SLOT, make_config("L2"))
    assert (probed.rule, probed.bits, probed.reason, probed.seed) == (LINEAR, 4, "", 123)
    for rule in (smooth, LINEAR, ATTENTION, BOOL_MASK, EQUALITY, CHECKPOINT_INPUT):
        kept_exact = decide(X, rule, plan, other, make_config("L2", checkpoint_bits=2))
        assert (kept_exact.rule, kept_exact.reason) == (rule, "exact")
    base = _plan(2).probing({}, exact=True)  # the base pass: nothing probed, everything exact
    assert decide(X, LINEAR, base, SLOT, make_config("L2")).reason == "exact"
    assert not _plan(2).probing(None, exact=True).exact  # no probe: the plan's own widths


def test_a_choice_goes_with_quantized_classes_only():
    sketch = gactx.Choice(2, "sketch", 0.5)
    plan = _plan(2, choices={SLOT: sketch})
    assert decide(X, LINEAR, plan, SLOT, make_config("L1")).choice == sketch
    assert decide(X, rule_for(Site("gelu", role="self")), plan, SLOT, make_config("L1")).choice is None


def test_a_compiled_save_takes_the_width_the_allocation_gave_its_modules():
    plan = gactx.Plan.initial(2, True, 0).allocated({}, {}, compiled=(("block", (4, 64), torch.float32, 8),))
    config = make_config("L2.2")
    assert decide(X, LINEAR, plan, GraphSlot(("block",), (4, 64), torch.float32), config).bits == 8
    assert decide(X, LINEAR, plan, GraphSlot(("other",), (4, 64), torch.float32), config).bits == 2  # the default


def test_kept_decisions_carry_the_policys_reason():
    d = kept("small")
    assert (d.rule, d.bits, d.reason, d.cls) == (None, None, "small", "") and kept("small") is d


def test_what_a_later_save_may_share():
    config = make_config("L1")
    mat1, product = Site("addmm", role="mat1", weight_operand=True), Site("bmm", role="self")
    linear1, linear2, linear4 = (decide(X, LINEAR, _plan(b), SLOT, config) for b in (1, 2, 4))
    attention = decide(X, ATTENTION, _plan(2), SLOT, config)
    assert may_share(linear1, decide(X, LINEAR, _plan(1), SLOT, config), product)
    assert may_share(linear4, attention, product)
    assert not may_share(linear2, attention, product)  # narrower than attention's floor: it stores its own
    sketch = decide(X, LINEAR, _plan(2, choices={SLOT: gactx.Choice(2, "sketch", 0.5)}), SLOT, config)
    assert may_share(sketch, linear2, mat1)  # another weight's input: the same rows serve its gradient
    assert not may_share(sketch, linear2, product) and not may_share(sketch, linear2, None)


def test_a_compiled_graph_reads_the_same_op_table():
    assert graph_result_rule("amax") is EQUALITY and graph_result_rule("max") is EQUALITY
    assert graph_result_rule("sqrt") is LOG and graph_result_rule("_log_softmax") is LOG
    assert graph_result_rule("exp") is ATTENTION and graph_result_rule("_softmax") is ATTENTION
    # Rules a graph cannot store (masks, FewBit codes) and rules that read the op's scalar arguments: none.
    for op in ("relu", "sigmoid", "tanh", "pow", "linalg_vector_norm", "mm", "gelu"):
        assert graph_result_rule(op) is None, op
