"""The op zoo: aten ops whose backward reads what they saved, one at a time, under every fixed level.

Each case is a function of one activation ``x`` (a non-leaf: ``x = leaf * 1``). The gradient of ``x`` under
the controller is compared with plain PyTorch's: always finite; bit-identical for the lossless classes
(threshold, unused values, dropout, equality, log domain); cosine >= 0.999 at 8 bits otherwise. The
record of the save must carry the class the rule table gives, so a case cannot pass by being missed.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx
from gactx.controller.rules import MIN_BITS

LOSSLESS = {"threshold", "unused values", "dropout", "equality", "log domain"}


def _scatter_amax(x):
    index = torch.arange(x.shape[0]) % 5
    return x.new_zeros(5, x.shape[1]).scatter_reduce(0, index[:, None].expand_as(x), x, "amax", include_self=False)


def _index_amin(x):
    index = torch.arange(x.shape[0]) % 3
    return x.new_zeros(3, x.shape[1]).index_reduce(0, index, x, "amin", include_self=False)


def _ctc(x):
    log_probs = x.reshape(16, 4, 32).log_softmax(2)
    targets = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [3, 3, 1]])
    return F.ctc_loss(log_probs, targets, torch.full((4,), 16), torch.full((4,), 3), reduction="sum")


def _softmax_by_hand(x):
    """As torch_geometric computes GAT's coefficients: shifted by the maximum, exp, divided by the sum."""
    e = (x * 3 - (x * 3).amax(1, keepdim=True)).exp()
    return e / e.sum(1, keepdim=True)


def _sdpa(x):
    q = x.reshape(2, 4, 32, 8)
    return F.scaled_dot_product_attention(q, q.flip(2), q * 0.5)


def _dropout_scale(x):
    return F.dropout(x, 0.25)


def _ties(x):
    """``x`` rounded to integers (many equal values), with the gradient of ``x``."""
    return x + (x.detach().round() - x.detach())


_POS = lambda x: x.abs() + 0.5  # noqa: E731 - inputs of the log and reciprocal domain: away from 0

# name: (function of x, input shape, class expected of the save the case is about)
CASES = {
    # threshold and sign: masks
    "relu": (F.relu, (32, 64), "threshold"),
    "relu_": (lambda x: F.relu(x * 1, inplace=True), (32, 64), "threshold"),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.1), (32, 64), "threshold"),
    "leaky_relu_": (lambda x: F.leaky_relu(x * 1, 0.2, inplace=True), (32, 64), "threshold"),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 0.7), (32, 64), "threshold"),
    "relu6": (lambda x: F.relu6(x * 4), (32, 64), "threshold"),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), (32, 64), "threshold"),
    "clamp_min": (lambda x: x.clamp(min=0.1), (32, 64), "threshold"),
    "clamp_max_op": (lambda x: torch.clamp_max(x, 0.3), (32, 64), "threshold"),
    "hardsigmoid": (lambda x: F.hardsigmoid(x * 4), (32, 64), "threshold"),
    "threshold": (lambda x: F.threshold(x, 0.1, -2.0), (32, 64), "threshold"),
    "hardshrink": (F.hardshrink, (32, 64), "threshold"),
    "softshrink": (lambda x: F.softshrink(x, 0.3), (32, 64), "threshold"),
    "abs": (torch.abs, (32, 64), "threshold"),
    # values backward does not read
    "max_pool2d": (lambda x: F.max_pool2d(x.reshape(4, 8, 8, 8), 2), (32, 64), "unused values"),
    "max_pool2d_channels_last": (
        lambda x: F.max_pool2d(x.reshape(4, 8, 8, 8).contiguous(memory_format=torch.channels_last), 3, 2, 1),
        (32, 64),
        "unused values",
    ),
    "avg_pool2d": (lambda x: F.avg_pool2d(x.reshape(4, 8, 8, 8), 2), (32, 64), "unused values"),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x.reshape(4, 8, 8, 8), 3), (32, 64), "unused values"),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x.reshape(4, 8, 8, 8), 3), (32, 64), "unused values"),
    "max_pool3d": (lambda x: F.max_pool3d(x.reshape(2, 4, 4, 8, 8), 2), (32, 64), "unused values"),
    "max_pool1d": (lambda x: F.max_pool1d(x.reshape(8, 4, 64), 2), (32, 64), "unused values"),
    # float dropout masks
    "dropout": (_dropout_scale, (32, 64), "dropout"),
    "dropout_inplace": (lambda x: F.dropout(x * 1, 0.5, inplace=True), (32, 64), "dropout"),
    # smooth activations: FewBit codes
    "gelu": (F.gelu, (32, 64), "smooth"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), (32, 64), "smooth"),
    "silu": (F.silu, (32, 64), "smooth"),
    "mish": (F.mish, (32, 64), "smooth"),
    "elu": (F.elu, (32, 64), "smooth"),
    "selu": (F.selu, (32, 64), "smooth"),
    "celu": (lambda x: F.celu(x, 0.5), (32, 64), "smooth"),
    "softplus": (lambda x: F.softplus(x, beta=2.0), (32, 64), "smooth"),
    "hardswish": (lambda x: F.hardswish(x * 3), (32, 64), "smooth"),
    "sigmoid": (torch.sigmoid, (32, 64), "smooth"),
    "tanh": (torch.tanh, (32, 64), "smooth"),
    # attention
    "softmax": (lambda x: torch.softmax(x * 3, dim=1), (32, 64), "attention"),
    "sdpa": (_sdpa, (32, 64), "attention logits"),
    "exp": (lambda x: x.exp(), (32, 64), "attention"),
    "softmax by hand": (_softmax_by_hand, (32, 64), "attention"),
    # equality
    "amax": (lambda x: x.amax(1), (32, 64), "equality"),
    "amin_ties": (lambda x: _ties(x).amin(0), (32, 64), "equality"),
    "max": (lambda x: x.max(), (32, 64), "equality"),
    "min_ties": (lambda x: _ties(x * 0.3).min(), (32, 64), "equality"),
    "maximum": (lambda x: torch.maximum(x, x.flip(0)), (32, 64), "equality"),
    "minimum": (lambda x: torch.minimum(_ties(x), _ties(x).flip(1)), (32, 64), "equality"),
    "fmax": (lambda x: torch.fmax(x, x.roll(3, 1)), (32, 64), "equality"),
    "scatter_amax": (_scatter_amax, (32, 64), "equality"),
    "index_amin": (_index_amin, (32, 64), "equality"),
    "norm_inf": (lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1), (32, 64), "equality"),
    # reciprocal and log domain
    "sqrt": (lambda x: _POS(x).sqrt(), (32, 64), "log domain"),
    "rsqrt": (lambda x: _POS(x).rsqrt(), (32, 64), "log domain"),
    "reciprocal": (lambda x: _POS(x).reciprocal(), (32, 64), "log domain"),
    "log": (lambda x: _POS(x).log(), (32, 64), "log domain"),
    "log1p": (lambda x: _POS(x).log1p(), (32, 64), "log domain"),
    "log2": (lambda x: _POS(x).log2(), (32, 64), "log domain"),
    "div": (lambda x: torch.full_like(x, 2.0) / _POS(x), (32, 64), "log domain"),
    "pow_half": (lambda x: _POS(x) ** 0.5, (32, 64), "log domain"),
    "pow_neg": (lambda x: _POS(x) ** -1.5, (32, 64), "log domain"),
    "logsumexp": (lambda x: torch.logsumexp(x * 4, 1), (32, 64), "log domain"),
    "log_softmax": (lambda x: F.log_softmax(x * 4, 1), (32, 64), "log domain"),
    "ctc_loss": (_ctc, (32, 64), "log domain"),
    "prod": (lambda x: (_POS(x) * 0.5 + 0.7).prod(1), (32, 64), "log domain"),
    "cumprod": (lambda x: (_POS(x) * 0.2 + 0.9).cumprod(1), (32, 64), "log domain"),
    "norm2": (lambda x: torch.linalg.vector_norm(x, 2, dim=1), (32, 64), "log domain"),
    "logsigmoid": (F.logsigmoid, (32, 64), "log domain"),
    "atan2": (lambda x: torch.atan2(x, x.roll(1, 1)), (32, 64), "log domain"),
    "bce": (lambda x: F.binary_cross_entropy((_POS(x) + 1).reciprocal(), (x > 0).float()), (32, 64), "log domain"),
    # linear in what they save: the allocator's
    "mul": (lambda x: x * x.roll(1, 0), (32, 64), "linear"),
    "matmul": (lambda x: x @ x.T, (32, 64), "linear"),
    "layer_norm": (lambda x: F.layer_norm(x, (64,)), (32, 64), "linear"),
}


# Cases whose op also saves a tensor it uses linearly (the input of a 2-norm, quantized as linear).
MIXED = {"norm2", "div", "bce"}  # a 2-norm input, a numerator, a target: linear saves


class OpModel(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _input(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _grad(case, controller=None, seed=0, dtype=torch.float32):
    fn, shape, _ = CASES[case]
    model = OpModel(fn)
    leaf = _input(shape).to(dtype).requires_grad_()
    if controller is not None:
        controller = controller(model)
        controller.install_hook()
    torch.manual_seed(seed)  # dropout draws the same mask in every run
    try:
        out = model(leaf * 1)
    finally:
        if controller is not None:
            controller.uninstall_hook()
    weight = _input(out.shape, seed=1).to(out.dtype)
    (out * weight).sum().backward()
    return leaf.grad, controller


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", ["L1.1", "L1", "L1.2"])
def test_op_gradients(case, level):
    plain, _ = _grad(case)
    got, controller = _grad(case, lambda m: gactx.Controller(m, level=level, min_numel=0))
    expected = CASES[case][2]
    classes = {r.cls for r in controller.records}
    assert expected in classes, f"{case}: expected a {expected!r} save, got {classes}"
    assert torch.isfinite(got).all() == torch.isfinite(plain).all()
    # "": kept by the policy (integers, small); lossless only where every save of the case is
    if all(r.cls in LOSSLESS | {""} for r in controller.records):
        assert torch.equal(got, plain), f"{case} at {level}: the {expected} class must be lossless"
    else:
        assert expected not in LOSSLESS or case in MIXED, f"{case}: a lossless case with a lossy save"
    if level == "L1.1":
        assert F.cosine_similarity(got.flatten(), plain.flatten(), dim=0) >= 0.999
    least = MIN_BITS.get(expected)
    if least is not None:
        assert all(r.bits >= least for r in controller.records if r.cls == expected), controller.report()


def test_the_zoo_covers_every_class_with_forty_ops():
    assert len(CASES) >= 40
    assert {c for _, _, c in CASES.values()} == LOSSLESS | {"smooth", "attention", "attention logits", "linear"}


HALF_CASES = ["relu", "hardtanh", "clamp", "clamp_min", "threshold", "softshrink", "hardsigmoid", "abs", "max_pool2d"]


@pytest.mark.parametrize("case", HALF_CASES + ["dropout", "amax", "sqrt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lossless_classes_in_half_precision(case, dtype):
    """Bounds that fp16/bf16 cannot hold (0.3, 0.7) keep the tensor as is; the rest are masks."""
    plain, _ = _grad(case, dtype=dtype)
    got, controller = _grad(case, lambda m: gactx.Controller(m, level="L1.2", min_numel=0), dtype=dtype)
    assert torch.equal(got, plain)
    if CASES[case][2] == "threshold":
        (record,) = [r for r in controller.records if r.cls == "threshold"]
        assert (record.reason == "kept") == (case in ("hardtanh", "clamp_min", "threshold", "softshrink"))


def test_float_dropout_mask_is_stored_in_one_bit():
    _, controller = _grad("dropout", lambda m: gactx.Controller(m, level="L1.1", min_numel=0))
    (mask,) = [r for r in controller.records if r.cls == "dropout"]
    assert mask.bits == 1 and mask.packed_bytes == math.ceil(32 * 64 / 8) + 2 * 4


def test_float_dropout_masks_saved_outside_the_model_come_back_exactly():
    """ActNN's functional dropout: F.dropout chained in a plain training step, after the model's forward. On a CPU
    each multiplies by a float mask of 0 and 1/(1-p) that no module's forward made: kept, not quantized."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)

    def step():
        torch.manual_seed(1)
        y = model(x)
        for _ in range(10):
            y = F.dropout(y, p=0.2)
        y.pow(2).sum().backward()
        grad, x.grad = x.grad, None
        model.zero_grad()
        return grad

    plain = [step() for _ in range(2)]
    controller = gactx.Controller(model, level="L1", min_numel=0)
    controller.install_hook()
    try:
        for expected in plain:
            assert torch.equal(step(), expected)
    finally:
        controller.uninstall_hook()
    outside = [r for r in controller.records if r.cls == "no history (op unknown)"]
    assert len(outside) == 10 and all(r.reason == "kept" for r in outside)
