"""gactx/controller/adaptation/trained.py: what a training pass's record of an allocated save tells an estimate's
probe passes."""

import pytest
import torch

from gactx.controller.adaptation import trained
from gactx.controller.adaptation.choices import Choice
from gactx.controller.adaptation.widths import variance_factor
from gactx.controller.identity import Key
from gactx.controller.stats import AS_IS, KeyRecord

KEY = Key("layer", 1, 0, (4, 8))


def _record(bits=2, cls="linear", form="", reason="") -> KeyRecord:
    return KeyRecord(KEY, torch.float32, bits, 128, 16, 128, "mm:self", cls, form, reason)


def test_noise_is_the_width_s_variance_factor_or_nothing_where_kept():
    assert trained.noise(_record(bits=3)) == variance_factor(3)
    assert trained.noise(_record(bits=16, reason=AS_IS)) == 0.0
    assert trained.noise(_record(bits=32)) == 0.0  # past 8 bits: stored as it is


def test_uniform_codes_are_probed_in_their_form_and_give_a_linear_save_its_context():
    record = _record(bits=4)
    form = trained.stored_form(record, None, {}, 4)
    assert form == (4, None, variance_factor(4))
    assert trained.context(record, form) == variance_factor(4)
    assert trained.context(_record(bits=16, reason=AS_IS), None) == 0.0  # stored as it is: no noise around it


def test_a_save_whose_backward_is_not_linear_in_it_has_no_context():
    record = _record(cls="attention")
    assert trained.context(record, trained.stored_form(record, None, {}, 4)) is None
    assert trained.stored_form(_record(cls="smooth"), None, {}, 4) is None  # FewBit codes: no probe stores them


@pytest.mark.parametrize("known", [True, False])
def test_the_normal_scheme_is_priced_from_the_meter_s_errors(known, monkeypatch):
    monkeypatch.setattr(trained, "NORMAL_CONTEXT", known)
    choice = Choice(2, "normal")
    measured = {KEY[:3]: {Choice(4): 1.0, choice: 3.0}}
    form = trained.stored_form(_record(bits=2, form="normal"), choice, measured, 4)
    assert form == ((2, choice, 3.0 * variance_factor(4)) if known else None)
    assert trained.stored_form(_record(bits=2, form="normal"), choice, {}, 4) is None  # no reference measured
