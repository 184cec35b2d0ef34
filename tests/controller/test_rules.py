"""The rule table: sites map to the classes docs/levels.md documents, scalar arguments matter where they must,
and results name their op through their grad_fn once."""

import dataclasses
import math

import pytest
import torch

from gactx.controller.rules import (
    ATTENTION_BITS,
    LOGITS_BITS,
    MIN_BITS,
    Site,
    curved,
    matrix_partner,
    output_rule,
    rule_for,
    sketchable,
)
from gactx.controller.store import mask_values, round_to

SITES = [
    (Site("relu", role="result"), "threshold", "mask"),
    (Site("relu", role="self"), "linear", "quantize"),  # relu saves its result, never its input
    (Site("abs", role="self"), "threshold", "sign"),
    (Site("max_pool2d_with_indices", role="self"), "unused values", "unused"),
    (Site("gelu", role="self", params=(("approximate", "tanh"),)), "smooth", "fewbit"),
    (Site("sigmoid", role="result"), "smooth", "fewbit"),
    (Site("_softmax", role="result"), "attention", "quantize"),
    (Site("exp", role="result"), "attention", "quantize"),
    (Site("_scaled_dot_product_flash_attention_for_cpu", role="key"), "attention logits", "quantize"),
    (Site("_scaled_dot_product_efficient_attention", role="query"), "attention logits", "quantize"),
    (Site("_scaled_dot_product_flash_attention_for_cpu", role="value"), "attention", "quantize"),
    (Site("_scaled_dot_product_efficient_attention", role="output", result=True), "attention", "quantize"),
    (Site("mul", "Tensor", "other", broadcast=True), "broadcast factor", "keep"),  # rotary cos and sin
    (Site("mul", "Tensor", "self", broadcast=True), "broadcast factor", "keep"),
    (Site("mul", "Tensor", "self"), "linear", "quantize"),
    (Site("_scaled_dot_product_flash_attention_for_cpu", role="logsumexp"), "log domain", "keep"),
    (Site("amax", role="self"), "equality", "keep"),
    (Site("scatter_reduce", "two", "src", (("reduce", "amax"),)), "equality", "keep"),
    (Site("scatter_reduce", "two", "src", (("reduce", "sum"),)), "linear", "quantize"),
    (Site("scatter_reduce_", "two", "src", (("reduce", "amin"),)), "equality", "keep"),
    (Site("linalg_vector_norm", role="self", params=(("ord", math.inf),)), "equality", "keep"),
    (Site("linalg_vector_norm", role="result", params=(("ord", 2),)), "log domain", "keep"),
    (Site("linalg_vector_norm", role="self", params=(("ord", 2),)), "linear", "quantize"),
    (Site("div", "Tensor", "other"), "log domain", "keep"),
    (Site("div", "Tensor", "self"), "linear", "quantize"),
    (Site("pow", "Tensor_Scalar", "self", (("exponent", 2),)), "linear", "quantize"),
    (Site("pow", "Tensor_Scalar", "self", (("exponent", 0.5),)), "log domain", "keep"),
    (Site("clamp", "Tensor", "self"), "equality", "keep"),
    (Site("clamp", "default", "self", (("min", None), ("max", None))), "linear", "quantize"),
    (Site("addmm", role="mat1"), "linear", "quantize"),
    (Site("mul_", role="?"), "linear", "quantize"),
    (Site("native_layer_norm", role="input"), "linear", "quantize"),
    (Site("native_layer_norm", role="result1"), "statistics", "keep"),  # each row's mean
    (Site("native_layer_norm", role="result2"), "statistics", "keep"),  # and reciprocal deviation
    (Site("native_group_norm", role="result2"), "statistics", "keep"),
    (Site("native_batch_norm", role="result1"), "statistics", "keep"),
]


@pytest.mark.parametrize("site, cls, kind", SITES)
def test_sites_get_their_class(site, cls, kind):
    rule = rule_for(site)
    assert (rule.cls, rule.kind) == (cls, kind)


def test_attention_classes_have_a_minimum_width():
    assert ATTENTION_BITS == 4
    assert LOGITS_BITS == 8, "a fused attention's query and key at 4 bits let a decoder trained from scratch collapse"
    assert MIN_BITS == {"attention": ATTENTION_BITS, "attention logits": LOGITS_BITS}


def test_mask_values_sit_on_the_right_side_of_the_ops_test():
    hardtanh = rule_for(Site("hardtanh", role="self", params=(("min_val", -1.0), ("max_val", 1.0))))
    assert mask_values(hardtanh, torch.float32) == (-math.inf, 0.0)
    clamp = rule_for(Site("clamp", role="self", params=(("min", 0.25), ("max", None))))
    assert mask_values(clamp, torch.bfloat16) == (-math.inf, 0.25)
    # 0.1 has no exact bfloat16: the mask would depend on the kernel's comparison, so the tensor is kept
    assert mask_values(rule_for(Site("clamp", role="self", params=(("min", 0.1),))), torch.bfloat16) is None
    assert mask_values(rule_for(Site("clamp", role="self", params=(("min", 0.1),))), torch.float32) is not None
    # hardtanh bounds one bf16 step apart have no bf16 value strictly between them
    tight = rule_for(Site("hardtanh", role="self", params=(("min_val", 1.0), ("max_val", 1.0078125))))
    assert mask_values(tight, torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_to_matches_torch(dtype):
    for v in [0.1, 1 / 3, 0.7, 65504.0, 70000.0, -2.5e-8, 1e39, 3.0]:
        expected = float(torch.tensor(v, dtype=torch.float64).to(torch.float32).to(dtype))
        assert round_to(v, dtype) == expected, (v, dtype)


def test_output_rule_names_a_result_save_once():
    x = torch.randn(8, requires_grad=True)
    y = torch.relu(x * 1)
    claimed = set()
    site, rule = output_rule(y, claimed)
    assert (site.op, site.role, rule.cls) == ("relu", "result", "threshold")
    assert output_rule(y, claimed) is None, "a second save of the same result is another op's input"
    assert output_rule(x * 2, set()) is None, "mul does not save its result"


@pytest.mark.parametrize(
    "site, expected",
    [
        (Site("addmm", role="mat1", weight_operand=True), True),  # linear: addmm(bias, x, w.t())
        (Site("mm", role="self", weight_operand=True), True),  # linear without bias, matmul with a weight
        (Site("mm", role="mat2", weight_operand=True), True),  # a weight on the left: w @ x
        (Site("bmm", role="self", weight_operand=True), True),  # einsum with a weight
        (Site("baddbmm", role="batch2", weight_operand=True), True),
        (Site("addmv", role="vec", weight_operand=True), True),
        (Site("addmm", role="mat1"), False),  # a product of two activations (attention's q k^T, p v)
        (Site("bmm", role="mat2"), False),
        (Site("addmm", role="self", weight_operand=True), False),  # not a matrix operand: the bias
        (Site("convolution", role="input", weight_operand=True), False),  # not a product the table names
        (Site("native_layer_norm", role="input", weight_operand=True), False),
        (Site("relu", role="result", result=True, weight_operand=True), False),
        (Site("?", weight_operand=True), False),
    ],
)
def test_sketchable_saves_are_the_inputs_of_linear_layers(site, expected):
    assert sketchable(site) is expected


def test_matrix_partners():
    assert matrix_partner("addmm", "mat1") == "mat2" and matrix_partner("addmm", "mat2") == "mat1"
    assert matrix_partner("mm", "self") == "mat2" and matrix_partner("mv", "vec") == "self"
    assert matrix_partner("addmm", "self") is None and matrix_partner("mul", "self") is None


@pytest.mark.parametrize("site", [s for s, _, _ in SITES] + [Site(op, role="mat1") for op in ("addmm", "mm")])
def test_the_weight_flag_changes_no_class(site):
    flagged = dataclasses.replace(site, weight_operand=not site.weight_operand)
    assert rule_for(flagged) == rule_for(site)
    assert str(flagged) == str(site)


@pytest.mark.parametrize(
    "site, expected",
    [
        (Site("native_layer_norm", role="input"), True),
        (Site("native_batch_norm", role="input"), True),
        (Site("native_group_norm", role="input"), True),
        (Site("native_layer_norm", role="weight"), False),
        (Site("addmm", role="mat1"), False),
        (Site("linalg_vector_norm", role="self"), False),
    ],
)
def test_curved_saves_are_the_inputs_of_normalisations(site, expected):
    assert curved(site) is expected
