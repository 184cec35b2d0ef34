"""gactx/controller/sites.py: a slot's op as learned, recalled while the save there still looks the same, and the
queries of later saves that share what a first save stored."""

import torch

from gactx.controller.identity import Key, Slot
from gactx.controller.rules import PROVENANCE, UNKNOWN, Site, rule_for
from gactx.controller.sites import Sites, rule_of, signature

LINEAR_INPUT = Site("addmm", role="mat1", weight_operand=True)  # a linear layer's input: sketchable, weight only
NORM_INPUT = Site("native_batch_norm", role="input")


def _saved(fn=torch.tanh) -> torch.Tensor:
    return fn(torch.randn(4, 8, requires_grad=True))


def test_a_learned_op_is_recalled_while_the_save_looks_the_same():
    sites, t = Sites(), _saved()
    slot = Slot("block", 1, 0)
    sites.learn(t, slot, LINEAR_INPUT, None, rule_for(LINEAR_INPUT))
    assert len(sites) == 1
    assert sites.recall(_saved(), Key("block", 1, 0, (4, 8)), slot) == (LINEAR_INPUT, rule_for(LINEAR_INPUT), True)
    # Another node made it (another branch through the module): not what was learned, and no other save of the call
    # was learned with its signature.
    assert signature(_saved(torch.sigmoid)) != signature(t)
    assert sites.recall(_saved(torch.sigmoid), Key("block", 1, 0, (4, 8)), slot) is None


def test_a_save_numbered_apart_is_recalled_from_the_one_save_of_its_call_that_looks_the_same():
    sites = Sites()
    sites.learn(_saved(), Slot("block", 1, 0), LINEAR_INPUT, None, rule_for(LINEAR_INPUT))
    sites.learn(_saved(torch.sigmoid), Slot("block", 1, 1), NORM_INPUT, None, rule_for(NORM_INPUT))
    # The unwatched pass numbers the tanh save 2 (an extra save came before it): recalled, not learned for this slot.
    found = sites.recall(_saved(), Key("block", 1, 2, (4, 8)), Slot("block", 1, 2))
    assert found == (LINEAR_INPUT, rule_for(LINEAR_INPUT), False)
    assert sites.recall(_saved(), Key("other", 1, 2, (4, 8)), Slot("other", 1, 2)) is None


def test_sharers_decide_what_a_first_save_may_be_stored_as():
    sites = Sites()
    first, later = Slot("q", 1, 0), Slot("k", 1, 0)
    sites.learn(_saved(), first, LINEAR_INPUT, None, rule_for(LINEAR_INPUT))
    assert sites.sketchable(first) and sites.weight_only(first) and not sites.curved(first)
    assert sites.target(later) == later  # no save shared it yet
    sites.share(first, later, LINEAR_INPUT)
    assert sites.target(later) == first and sites.sharers == {first: {later: LINEAR_INPUT}}
    assert sites.sketchable(first)
    sites.share(first, Slot("v", 1, 0), None)  # a later save whose op is unknown
    assert not sites.sketchable(first) and not sites.weight_only(first)
    assert not sites.sketchable(Slot("never", 1, 0))  # nothing learned


def test_a_normalisations_input_is_curved():
    sites = Sites()
    sites.learn(_saved(), Slot("bn", 1, 0), NORM_INPUT, None, rule_for(NORM_INPUT))
    assert sites.curved(Slot("bn", 1, 0)) and not sites.sketchable(Slot("bn", 1, 0))


def test_rule_of_a_provenance_or_an_unknown_op():
    assert rule_of(LINEAR_INPUT, "dropout") is PROVENANCE["dropout"]
    assert rule_of(Site("?"), None) is UNKNOWN
    assert rule_of(LINEAR_INPUT, None) == rule_for(LINEAR_INPUT)
