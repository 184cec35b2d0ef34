"""A Controller's checkpoint: written as plain values, read back the same, and a malformed one refused by name."""

import json

import pytest
from torch import nn

import gactx
from gactx.controller.adaptation.choices import Choice
from gactx.controller.state import read_state, write_state


def test_a_state_reads_back_what_was_written_through_json():
    sensitivity = {("enc.0", 1, 0): 0.25, ("enc.1", 2, 3): 1e-9}
    bits = {("enc.0", 1, 0): 1, ("enc.1", 2, 3): 8}
    choices = {("enc.0", 1, 0): Choice(1, "sketch", 0.25, 8)}
    state = json.loads(json.dumps(write_state("L2.2", 7, sensitivity, bits, choices, [2000, 3000])))
    assert read_state(state, "L2.2") == (7, sensitivity, bits, choices, [2000, 3000])


def test_a_choice_for_a_slot_without_bits_is_refused():
    state = write_state("L2", 1, {}, {("a", 1, 0): 2}, {("b", 1, 0): Choice(2, "normal", 1.0, 8)}, [1000, 1000])
    with pytest.raises(ValueError, match="'choices' has a malformed row"):
        read_state(state, "L2")


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda s: s.pop("step"), "missing 'step'"),
        (lambda s: s.pop("bits"), "missing 'bits'"),
        (lambda s: s.update(step=-1), "'step' must be an int"),
        (lambda s: s.update(step=2.5), "'step' must be an int"),
        (lambda s: s.update(sensitivity="x"), "'sensitivity' must be a list"),
        (lambda s: s.update(bits=[["0", 1, 0]]), "'bits' has a malformed row"),
        (lambda s: s.update(bits=[["0", 1, 0, 2.5]]), "'bits' has a malformed row"),
        (lambda s: s.update(sensitivity=[["0", 1, 0, float("inf")]]), "'sensitivity' has a malformed row"),
        (lambda s: s.update(sensitivity=[[0, 1, 0, 1.0]]), "'sensitivity' has a malformed row"),
        (lambda s: s.update(schedule=[1000]), "'schedule' must be"),
        (lambda s: s.update(schedule=[1000, 0]), "'schedule' must be"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(change, field):
    model = nn.Linear(4, 4)
    state = {"version": 1, "level": "L2", "step": 3, "sensitivity": [["", 1, 0, 0.5]], "bits": [["", 1, 0, 4]]}
    controller = gactx.Controller(model, level="L2")
    controller.load_state_dict(dict(state))  # the well-formed state loads
    assert controller.step == 3 and controller.allocation == {("", 1, 0): 4}
    change(state)
    with pytest.raises(ValueError, match=field):
        gactx.Controller(model, level="L2").load_state_dict(state)
