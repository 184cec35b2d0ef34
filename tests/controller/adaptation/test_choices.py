"""gactx/controller/adaptation/choices.py: storage choices, their measured variance, and the allocator choosing
among them."""

import itertools
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gactx
from gactx.controller.adaptation.allocator import Item, allocate, variance_factor
from gactx.controller.adaptation.choices import Choice, ChoiceMeter, choice_options
from gactx.controller.rules import LINEAR
from gactx.kernels import schemes
from gactx.kernels.format import expected_nbytes
from gactx.kernels.schemes.samples import split_nbytes


def test_choices_name_themselves_and_their_bits():
    assert str(Choice(2)) == "2" and str(Choice(4, "normal")) == "4 normal"
    assert str(Choice(8, "sketch", 0.125)) == "8 sketch 1/8" and Choice(8, "sketch", 0.125).effective_bits == 1
    assert str(Choice(2, "samples", 0.25, 4)) == "2 samples 1/4 at 4"
    assert Choice(2, "samples", 0.25, 4).effective_bits == 2.5
    # Where a sketch no longer applies, uniform codes within its bits an element.
    assert Choice(8, "sketch", 0.25).fallback_bits == 2 and Choice(1, "sketch", 0.5).fallback_bits == 1
    assert Choice(2, "samples", 0.5, 4).fallback_bits == 2 and Choice(4, "normal").fallback_bits == 4


def test_options_scale_the_measured_errors_to_the_probe_width():
    measured = {Choice(1): 90.0, Choice(2): 10.0, Choice(4): 0.5, Choice(8): 0.002, Choice(2, "samples", 0.5, 4): 4.0}
    options = dict((c, (b, f)) for c, b, f in choice_options(measured, (64, 512), torch.float32, 256, 2))
    assert options[Choice(2)][1] == pytest.approx(variance_factor(2))  # the probe width: S(probe) itself
    assert options[Choice(1)][1] == pytest.approx(9 * variance_factor(2))
    assert options[Choice(32)] == (64 * 512 * 4, 0.0)
    assert options[Choice(16)][1] == pytest.approx(variance_factor(2) * 0.002 / 10 / 16)
    assert options[Choice(4)][0] == expected_nbytes(64 * 512, torch.float32, 4, 256)
    assert options[Choice(2, "samples", 0.5, 4)][0] == split_nbytes((64, 512), torch.float32, 2, 4, 0.5, 256)
    # A class's narrowest width drops the narrower choices; a 16-bit tensor is itself at 16.
    narrow = dict((c, (b, f)) for c, b, f in choice_options(measured, (64, 512), torch.bfloat16, 256, 2, 4))
    assert min(c.bits for c in narrow) == 4 and narrow[Choice(16)] == (64 * 512 * 2, 0.0)


def _brute_force(items, budget):
    best = None
    for picked in itertools.product(*[it.options for it in items]):
        if sum(o[1] for o in picked) <= budget:
            var = sum(it.sensitivity * o[2] for it, o in zip(items, picked, strict=True))
            best = var if best is None else min(best, var)
    return best


option = st.tuples(st.integers(1, 8), st.integers(1, 10_000), st.floats(0, 1, allow_nan=False))
items_strategy = st.lists(
    st.builds(
        lambda i, c, opts: Item(i, 1, torch.float32, c, options=tuple((Choice(b), n, f) for b, n, f in opts)),
        st.integers(0, 10**6),
        st.floats(0, 1e3, allow_nan=False),
        st.lists(option, min_size=1, max_size=4, unique_by=lambda o: o[0]),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda it: it.key,
)


@settings(max_examples=100, deadline=None)
@given(items=items_strategy, budget=st.integers(0, 30_000))
def test_explicit_options_are_allocated_optimally(items, budget):
    result = allocate(items, budget)
    best = _brute_force(items, budget)
    if best is None:
        assert not result.feasible
        return
    assert result.feasible and result.nbytes <= budget
    assert result.variance == pytest.approx(best, rel=1e-9, abs=1e-12)
    for it in items:
        assert result.choices[it.key] in [o[0] for o in it.options]
        assert result.bits[it.key] == result.choices[it.key].bits


class NoHostRead(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a host read inside the hook")
        return func(*args, **(kwargs or {}))


def test_the_meter_reads_nothing_on_the_host_until_asked():
    meter = ChoiceMeter(("uniform", "samples"), 256, lambda slot: False)
    meter.armed = True
    x = torch.randn(8, 512) * torch.logspace(-3, 0, 8)[:, None]
    with NoHostRead():
        meter(gactx.Key("m", 0, 0, (8, 512)), x, LINEAR)
    measured = meter.read()[("m", 0, 0)]
    assert {c.scheme for c in measured} == {"uniform", "samples"}
    assert measured[Choice(1)] > measured[Choice(2)] > measured[Choice(4)] > measured[Choice(8)] > 0
    # The samples of widest range carry the error: widening a quarter of them removes most of it.
    assert measured[Choice(2, "samples", 0.25, 4)] < 0.1 * measured[Choice(2)]
    assert meter.read() == {}


def _skewed_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    scales = torch.ones(32)
    scales[:4] = 100.0  # a few samples of a much wider range than the rest
    x = torch.randn(32, 256) * scales[:, None]
    y = torch.randint(0, 10, (32,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def _grad(model, run):
    for p in model.parameters():
        p.grad = None
    run().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_per_sample_widths_are_chosen_where_samples_differ_and_state_keeps_them():
    model, run = _skewed_mlp()
    exact = _grad(model, run)
    controller = gactx.Controller(model, "L2.2", schemes=("uniform", "samples"))
    with controller:
        _grad(model, run)
        controller.iterate(lambda: _grad(model, run))
        chosen = {slot: c for slot, c in controller.plan.choices.items()}
        assert any(c.scheme == "samples" for c in chosen.values())
        grads = []
        for _ in range(4):
            controller.step += 1
            grads.append(_grad(model, run))
        forms = {r.key[:3]: r.form for r in controller.records}
    assert all(forms[slot].startswith("samples") for slot in chosen)
    assert "samples" in controller.report()
    assert all(torch.isfinite(g).all() for g in grads)
    assert (torch.stack(grads).mean(0) - exact).norm() < exact.norm()
    state = controller.state_dict()
    other = gactx.Controller(model, "L2.2", schemes=("uniform", "samples"))
    other.load_state_dict(state)
    assert other.plan.choices == controller.plan.choices and other.allocation == controller.allocation


def test_malformed_choices_in_a_state_raise_naming_the_field():
    model, _ = _skewed_mlp()
    controller = gactx.Controller(model, "L2.2")
    state = {"version": 1, "level": "L2.2", "step": 3, "sensitivity": [], "bits": [["0", 0, 0, 2]]}
    controller.load_state_dict(state | {"choices": [["0", 0, 0, "samples", 0.25, 4]]})
    assert controller.plan.choices == {("0", 0, 0): Choice(2, "samples", 0.25, 4)}
    for bad in (["0", 0, 0, "fancy", 0.5, 0], ["0", 0, 1, "normal", 1.0, 0], ["0", 0, 0, "sketch", 2.0, 0]):
        with pytest.raises(ValueError, match="'choices'"):
            controller.load_state_dict(state | {"choices": [bad]})


def test_schemes_are_validated():
    assert gactx.Config(schemes=["uniform", "normal"]).schemes == ("uniform", "normal")
    for bad in (("normal",), ("uniform", "fancy"), ("uniform", "uniform"), "uniform"):
        with pytest.raises(ValueError, match="schemes"):
            gactx.Config(schemes=bad)


@pytest.mark.parametrize("estimator", ["gact", "actnn"])
def test_every_scheme_is_chosen_on_bert_and_its_gradient_stays_unbiased(estimator):
    from benchmarks.zoo import build

    model, unseeded = build("bert", 1)

    def run():
        torch.manual_seed(0)  # the same dropout masks in every pass
        return unseeded()

    exact = _grad(model, run)
    controller = gactx.Controller(model, "L2.2", schemes=schemes.names(), estimator=estimator)
    with controller:
        _grad(model, run)
        controller.iterate(lambda: _grad(model, run))
        chosen = dict(controller.plan.choices)
        grads = []
        for _ in range(8):
            controller.step += 1
            grads.append(_grad(model, run))
        records = {r.key[:3]: r for r in controller.records}
    assert {"normal", "sketch"} <= {c.scheme for c in chosen.values()}
    for slot, c in chosen.items():  # stored as chosen, within the bytes the allocator counted
        assert records[slot].form == str(c).split(" ", 1)[1]
    assert controller.last_adaptation.allocated_bytes <= controller.last_adaptation.budget_bytes
    single = statistics.mean(float((g - exact).square().sum()) for g in grads)
    mean = torch.stack(grads).mean(0)
    assert float((mean - exact).square().sum()) < 0.5 * single  # 1/8 of it for unbiased draws


def test_a_probed_sketch_calibrates_every_sketch_of_its_tensor():
    from gactx.controller.adaptation.choices import CALIBRATION_SKETCH, calibration

    measured = {Choice(b): 10.0 / 4**b for b in (1, 2, 4, 8)} | {
        CALIBRATION_SKETCH: 3.0,
        Choice(32, "sketch", 0.25): 9.0,
    }
    c = 2.0
    predicted = c * variance_factor(2) * 3.0 / measured[Choice(2)]
    assert calibration(measured, None, c, 2) == 1.0
    assert calibration(measured, {CALIBRATION_SKETCH: 4 * predicted}, c, 2) == pytest.approx(4.0)
    assert calibration(measured, {CALIBRATION_SKETCH: float("nan")}, c, 2) == 1.0
    plain = dict((o[0], o[2]) for o in choice_options(measured, (64, 512), torch.float32, 256, 2))
    scaled = dict((o[0], o[2]) for o in choice_options(measured, (64, 512), torch.float32, 256, 2, sketch_scale=4.0))
    assert scaled[Choice(32, "sketch", 0.25)] == pytest.approx(4 * plain[Choice(32, "sketch", 0.25)])
    rounding = plain[Choice(2, "sketch", 0.25)] - plain[Choice(32, "sketch", 0.25)]  # the kept rows' codes
    assert rounding == pytest.approx(plain[Choice(2)] / 0.25)
    assert scaled[Choice(2, "sketch", 0.25)] == pytest.approx(4 * plain[Choice(32, "sketch", 0.25)] + rounding)
    assert scaled[Choice(4)] == plain[Choice(4)]  # codes are not touched


def test_gact_probes_the_sketchable_tensors_together_with_their_calibration_pairs(monkeypatch):
    from benchmarks.zoo import build
    from gactx.controller.adaptation import gact_estimator, passes
    from gactx.controller.adaptation.choices import CALIBRATION_PAIRS

    # No groups: the two controllers' passes then differ by the calibration pairs alone, measured by every estimate
    # (else by the first alone: kept, below), the first of each pair in a pass against the exact base.
    monkeypatch.setattr(passes, "GROUPED", False)
    monkeypatch.setattr(gact_estimator, "KEEP_CALIBRATION", False)
    monkeypatch.setattr(gact_estimator, "UNEXPLAINED", math.inf)  # against the exact base throughout: counted so
    model, run = build("transformer_layer", 1)
    plain = gactx.Controller(model, "L2.2", schemes=("uniform",))
    sketching = gactx.Controller(model, "L2.2", schemes=("uniform", "sketch"))
    passes = {}
    for name, controller in (("plain", plain), ("sketching", sketching)):
        with controller:
            _grad(model, run)
            controller.iterate(lambda: _grad(model, run))
            passes[name] = controller.adapt(lambda: _grad(model, run)).passes  # one estimate (not the first)
    sketchable = [slot for slot in sketching.sensitivity if sketching.sketchable(slot)]
    # The inputs of linear1 and linear2 (modules that own their weight) are probed together, their pairs in one set of
    # passes; nn.MultiheadAttention's two projection inputs are made in one module that owns one of their two
    # weights (the other is its submodule's), so each is probed with its calibrations alone.
    alone = [slot for slot in sketchable if slot.module == "self_attn"]
    assert len(sketchable) == 4 and len(alone) == 2
    assert passes["sketching"] == passes["plain"] + CALIBRATION_PAIRS * (1 + len(alone))
    # Kept: an adaptation after the first measures no calibration (the sketches priced on the kept ratios).
    monkeypatch.setattr(gact_estimator, "KEEP_CALIBRATION", True)
    for name, offered in (("plain", ("uniform",)), ("sketching", ("uniform", "sketch"))):
        controller = gactx.Controller(model, "L2.2", schemes=offered)
        with controller:
            _grad(model, run)
            controller.iterate(lambda: _grad(model, run))
            passes[name] = controller.adapt(lambda: _grad(model, run)).passes
    assert passes["sketching"] == passes["plain"]
