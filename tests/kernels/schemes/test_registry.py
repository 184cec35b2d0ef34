"""gactx/kernels/schemes: the storage schemes' registry. A scheme added with one register() call is measured, offered
to the allocator, chosen, stored, recorded and decoded, with no other file of gactx touched."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx
from gactx.kernels import schemes
from gactx.kernels.schemes import Choice, Scheme


@dataclass(frozen=True, eq=False)
class HalfTensor:
    """What the example scheme stores: the values in float16 (rounded to nearest) and the dtype to decode to."""

    values: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.values.numel() * 2

    def decode(self) -> torch.Tensor:
        return self.values.to(self.dtype)


class HalfScheme(Scheme):
    """An example scheme: float16 values, 16 bits an element, no metadata."""

    name = "half"

    def measure(self, x, flat, group_size, sketchable):
        error = (flat.to(torch.float16).float() - flat.float()).square().sum()
        return {Choice(16, "half"): error}

    def nbytes(self, shape, dtype, choice, group_size):
        return torch.Size(shape).numel() * 2

    def encode(self, t, choice, seed, group_size, stochastic, backend, sketchable):
        if t.dtype != torch.float32:
            return None
        return HalfTensor(t.detach().to(torch.float16), t.dtype)


@pytest.fixture
def half():
    scheme = schemes.register(HalfScheme())
    yield scheme
    schemes.unregister("half")


def test_the_built_in_schemes_are_registered():
    assert schemes.names() == ("uniform", "normal", "sketch", "samples")
    assert str(Choice(2)) == "2" and str(Choice(4, "normal")) == "4 normal"
    assert str(Choice(2, "sketch", 0.25)) == "2 sketch 1/4" and Choice(2, "sketch", 0.25).fallback_bits == 1
    assert str(Choice(2, "samples", 0.25, 4)) == "2 samples 1/4 at 4"
    assert Choice(2, "samples", 0.5, 4).effective_bits == 3


def test_a_name_is_registered_once_and_built_in_schemes_stay():
    with pytest.raises(ValueError, match="registered already"):
        schemes.register(schemes.scheme("uniform"))
    with pytest.raises(ValueError, match="built in"):
        schemes.unregister("sketch")
    with pytest.raises(ValueError, match="not registered"):
        schemes.scheme("half")


def test_an_unregistered_scheme_is_refused_by_the_config():
    with pytest.raises(ValueError, match="schemes="):
        gactx.Controller(nn.Linear(4, 4), "L2", schemes=("uniform", "half"))


def test_a_registered_scheme_is_measured_chosen_stored_and_decoded(half):
    torch.manual_seed(0)
    # GELU saves its input, which no linear layer saves: each allocated save has a storage of its own, and the budget
    # of 16 bits an element of what plain PyTorch saves gives each of them 16 bits.
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def run():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    plain = run()
    # 16 bits on average: float16 (error 2**-11 of a value) beats bfloat16 (2**-8) at the same bytes.
    controller = gactx.Controller(model, "L2", bits=16, schemes=("uniform", "half"))
    with controller:
        run()
        controller.iterate(run)
        got = run()
    chosen = {slot: c for slot, c in controller.plan.choices.items() if c.scheme == "half"}
    assert chosen, controller.report()
    halves = [r for r in controller.records if r.form == "half"]
    assert {r.key.slot for r in halves} == set(chosen)
    assert all(r.bits == 16 and r.packed_bytes == r.original_bytes // 2 for r in halves)
    assert "16 half" in controller.report()
    assert F.cosine_similarity(got, plain, 0) > 0.99999


def test_the_ahead_of_time_tool_collects_each_schemes_kernel_specs():
    from gactx.kernels import aot
    from gactx.kernels.schemes.uniform.specs import SPECS as UNIFORM

    for name in ("uniform", "normal"):  # the folders with Triton kernels list them in their specs.py
        assert set(schemes.scheme(name).kernel_specs()) <= set(aot.FAMILIES)
    assert schemes.scheme("sketch").kernel_specs() == {}  # torch ops alone: nothing to compile
    assert aot.families()[:2] == ("quantize", "dequantize") and "pack_bool" in aot.FAMILIES

    class WithKernels(HalfScheme):  # a scheme with kernels of its own (here, the uniform scheme's, renamed)
        name = "half_kernels"

        def kernel_specs(self):
            return {"half_quantize": lambda bits=None: UNIFORM["quantize"](bits)[:3]}

    schemes.register(WithKernels())
    try:
        assert "half_quantize" in aot.families()
        assert aot.specs(["half_quantize"]) == UNIFORM["quantize"]()[:3]
    finally:
        schemes.unregister("half_kernels")
    assert "half_quantize" not in aot.families()
    with pytest.raises(ValueError, match="families="):
        aot.specs(["half_quantize"])


def test_a_measurement_in_one_piece_reads_as_a_mapping():
    choices = (Choice(1), Choice(2), Choice(4, "normal"))
    measured = schemes.Measured(choices, torch.tensor([3.0, 1.0, 0.25]))
    assert list(measured) == list(choices) and len(measured) == 3
    assert float(measured[Choice(4, "normal")]) == 0.25 and dict(measured).keys() == set(choices)
    assert Choice(8) not in measured
    with pytest.raises(KeyError):
        measured[Choice(8)]
