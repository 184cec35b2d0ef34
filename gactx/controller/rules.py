"""The op rules: how the backward of the op that saved a tensor uses it, and so what must be stored.

Stochastic rounding makes a stored tensor unbiased; the gradient is unbiased only where backward is linear
in it (inputs of linear, matmul, conv, normalisation). :func:`rule_for` maps a :class:`Site` (the aten op,
which of its arguments or results the tensor is, and the op's scalar arguments) to a :class:`Rule`:

==============  ============================================================  ===========================
class           ops (the saved argument)                                      stored
==============  ============================================================  ===========================
threshold       relu, relu_ (result); leaky_relu, threshold, hardtanh (relu6),  1-bit mask (abs: 2-bit sign)
                clamp/clamp_min/clamp_max with number bounds, hardsigmoid,     decoded to values on the
                hardshrink, softshrink, abs (self); leaky_relu_, hardtanh_     right side of the op's own
                (result)                                                       test: lossless
unused values   max/avg/adaptive pooling inputs: backward reads their shape    nothing: zeros on unpack,
                                                                               lossless
dropout         a float dropout mask (values 0 and 1/(1-p)), by provenance     1-bit mask and the scale,
                                                                               lossless
smooth          gelu, silu, mish, elu/selu, celu, softplus, hardswish (self);  FewBit code, 1-8 bits
                sigmoid, tanh (result)                                        (``gactx.kernels.fewbit``)
attention       softmax results; exp results and what is divided out of them    quantized, >= ATTENTION_BITS
                (softmax by hand, as PyG's GAT computes its coefficients), by
                provenance; fused attention's value and output (SDPA)
attention       fused attention's query and key (SDPA: flash, efficient,        quantized, >= LOGITS_BITS
logits          cuDNN), from which backward recomputes the probabilities as
                exp(q k - logsumexp) with the exact logsumexp
equality        amax/amin, max/min reductions, maximum/minimum, fmax/fmin,     kept as is
                scatter_reduce/index_reduce with amax/amin/prod, inf-norms,
                clamp with tensor bounds
log domain      sqrt, rsqrt, reciprocal (result); log, log1p, log2, log10,     kept as is
                pow with an exponent other than 0, 1, 2 (self); div
                denominators; logsumexp, log_softmax, ctc_loss, prod,
                cumprod, norms and std (results), log_sigmoid, atan2,
                binary cross-entropy, attention's logsumexp and mask
broadcast       an operand of an element-wise product broadcast against the    kept as is
factor          other, which has the product's shape (rotary embeddings'
                cos and sin, a per-channel gate)
statistics      normalisation's saved mean and reciprocal deviation (layer,    kept as is
                group and batch norm results): backward rescales each row by
                them, and they are a few values a row
checkpoint      a non-reentrant checkpoint's region inputs (``checkpoint.py``):  quantized at the level's
input           backward recomputes the region from them                      ``checkpoint_bits``
linear          everything else                                               quantized, bits from the
                                                                              level or the allocator
==============  ============================================================  ===========================

A tensor whose op is not known (saved outside the model's forward, inside a compiled region, by a custom
``autograd.Function``) is ``linear`` unless it is an output whose ``grad_fn`` names its op (free to read). Outside
the model's forward, where no op is watched, a tensor with no autograd history (no ``grad_fn``, not requiring grad)
is ``no history (op unknown)`` and kept as is: it may be a float dropout mask made by functional code
(``F.dropout`` on a CPU multiplies by a float mask of 0 and 1/(1-p)), which only its provenance tells.

Inputs of linear layers may also be stored as a sketch of their rows (``gactx.kernels.schemes.sketch``: FewBit's
randomized linear): :func:`sketchable` says which saves. For ``y = x W^T`` backward reads ``x`` only in
``grad_W = g^T x``, linear in ``x``, and ``grad_x = g W`` never reads it; so an unbiased estimate of ``x`` keeps
``grad_W`` unbiased and ``grad_x`` exact. That holds for the activation operand of a matrix product whose other
operand is a weight (``Site.weight_operand``, set by the op watcher), and for no other save: in a product of two
activations (attention's ``Q K^T``, ``P V``) a sketch of one makes the other's gradient inexact, and the inputs of
normalisation, convolution and element-wise ops are read by backward in other ways. The flag changes no class:
``rule_for`` reads the op and role only.

The input of a normalisation is ``linear`` too, but its backward is not linear in it: the input gradient
normalises the saved input again and multiplies it by a sum over the row that holds it as well
(``x_hat * sum(g w x_hat)``), so its rounding error enters twice and the gradient variance grows with the square of
the stored error as much as with the error. :func:`curved` names these saves; the sensitivity estimator measures
them at two widths (``adaptation/sensitivity.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = [
    "ALLOCATED",
    "ATTENTION",
    "ATTENTION_BITS",
    "LOGITS",
    "LOGITS_BITS",
    "MIN_BITS",
    "EQUALITY",
    "FACTOR",
    "LOG",
    "PROVENANCE",
    "Rule",
    "Site",
    "rule_for",
    "graph_result_rule",
    "linear_power",
    "output_rule",
    "matrix_partner",
    "sketchable",
    "weight_only",
    "weight_partner",
    "curved",
    "LINEAR",
    "CHECKPOINT_INPUT",
    "UNKNOWN",
    "CONSTANT",
]

# Softmax outputs and attention probabilities, by measurement (benchmarks/oprules.py): quantized at 2 bits, one
# draw of the softmax backward is off by about 80% of its norm (20% at 4 bits); the error is nearly all
# variance (the mean of 32 draws has the cosine that noise of that size alone leaves, within 0.003). The
# character-level transformer at L1.2 ends 1.08% above full precision's loss with attention at 2 bits and
# 0.75% at 4 (8.9x and 8.4x smaller).
ATTENTION_BITS = 4
# Fused attention's query and key. Its backward recomputes each probability as exp(q k / sqrt(d) - logsumexp) from the
# stored q and k and the exact logsumexp: noise in a logit multiplies its probability by exp(noise), a factor whose
# mean exceeds 1 and which grows with the logits' size as training sharpens attention. A Llama-style decoder trained
# from scratch (benchmarks/quality.py) collapses at 4 bits once attention sharpens (its loss climbs back towards
# uniform's) and trains like full precision at 8; query or key alone at 8 bits does not hold it.
LOGITS_BITS = 8


@dataclass(frozen=True)
class Site:
    """Which save this is: aten op (overload packet and overload), the argument or result name the tensor
    was saved as (``"?"``: not found among the op's arguments), the op's scalar arguments, whether it is
    a result save (the op's output, saved by the op's own node), and whether it is a matrix operand whose
    other operand is a weight (an ``nn.Parameter``, a view of one or an autocast copy of one: see
    :func:`matrix_partner`)."""

    op: str
    overload: str = "default"
    role: str = "?"
    params: tuple = ()
    result: bool = False
    weight_operand: bool = False
    broadcast: bool = False  # an element-wise product's operand with fewer elements than the product and the other

    @cached_property
    def label(self) -> str:
        """``str(site)``, made once: every save's record reads it."""
        if self.role == "?":
            return "?" if self.op == "?" else f"? (before {self.op})"
        return self.op if self.role in ("self", "result") else f"{self.op}:{self.role}"

    def param(self, name: str, default=None):
        for k, v in self.params:
            if k == name:
                return v
        return default

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class Rule:
    """``cls``: the class (see the module table). ``kind``: how it is stored: ``"quantize"``, ``"mask"``,
    ``"sign"``, ``"unused"``, ``"dropout"``, ``"fewbit"``, ``"keep"``. ``pred`` and ``values``: a mask's
    test and the values its false/true decode to; ``fn``: the FewBit function."""

    cls: str
    kind: str
    pred: tuple = ()
    values: tuple = ()
    fn: str = ""
    fn_params: tuple = ()

    @property
    def lossless(self) -> bool:
        return self.kind in ("mask", "sign", "unused", "dropout", "keep")

    @cached_property
    def form(self) -> tuple:
        """What is stored, the class aside: rules of one form store a tensor alike (LINEAR and ATTENTION share
        quantized codes)."""
        return (self.kind, self.pred, self.values, self.fn, self.fn_params)


LINEAR = Rule("linear", "quantize")
UNKNOWN = Rule("linear (op unknown)", "quantize")
# Outside the model's forward no op is watched: a tensor with no history saved there may be a float dropout mask
# (values 0 and 1/(1-p), which must come back exactly), and telling one would need its values read on the host.
CONSTANT = Rule("no history (op unknown)", "keep")
ATTENTION = Rule("attention", "quantize")
# An element-wise product's factor that is broadcast against the other operand, which has the product's shape:
# backward multiplies that operand's whole gradient by it, element by element, so its rounding error enters every
# element of that gradient at full size (a linear layer's input error is summed over the tokens first; so is an
# outer product's, whose operands are both broadcast). It is smaller than the product, often far smaller (rotary
# embeddings' cos and sin, one storage for every layer): kept. At L1.2 the decoder from scratch ends 23% above full
# precision with them at 8 bits and 31% with them at 2.
FACTOR = Rule("broadcast factor", "keep")
LOGITS = Rule("attention logits", "quantize")
EQUALITY = Rule("equality", "keep")
LOG = Rule("log domain", "keep")
STATISTICS = Rule("statistics", "keep")
UNUSED = Rule("unused values", "unused")
DROPOUT = Rule("dropout", "dropout")
CHECKPOINT_INPUT = Rule("checkpoint input", "quantize")  # its width is the level's checkpoint_bits
# What a tensor was made by, where its op alone does not tell (watch.py): a float dropout mask (``bernoulli_``
# then ``div_``), probabilities computed by hand (an ``exp`` result divided by a tensor).
PROVENANCE = {"dropout": DROPOUT, "probabilities": ATTENTION}
# Classes whose width the allocator picks, and the least width a class allows where it has one.
ALLOCATED = ("linear", "linear (op unknown)", "attention", "attention logits", "smooth")
MIN_BITS = {"attention": ATTENTION_BITS, "attention logits": LOGITS_BITS}

INF = math.inf


def _mask(pred: tuple, false_value: float, true_value: float) -> Rule:
    return Rule("threshold", "mask", pred, (false_value, true_value))


def _smooth(fn: str, params: tuple = ()) -> Rule:
    return Rule("smooth", "fewbit", fn=fn, fn_params=params)


def _hardtanh(site: Site) -> Rule:
    lo, hi = float(site.param("min_val", -1.0)), float(site.param("max_val", 1.0))
    # backward: zero where x <= lo or x >= hi; a true mask decodes to a point strictly inside (checked in the
    # tensor's dtype when the mask is built, see masks.py); false decodes to -inf.
    return _mask(("between", lo, hi), -INF, 0.5 * (lo + hi))


def _clamp(site: Site) -> Rule:
    lo, hi = site.param("min"), site.param("max")
    if lo is None and hi is None:
        return LINEAR
    # backward: grad where lo <= x <= hi (each bound only if given). No NaN as a decoded value: a kernel's
    # scalar and vectorized paths may disagree on comparisons with NaN.
    inside = float(lo) if lo is not None else float(hi)
    outside = -INF if lo is not None else INF
    return _mask(("closed", None if lo is None else float(lo), None if hi is None else float(hi)), outside, inside)


def _shrink(site: Site) -> Rule:
    lam = float(site.param("lambd", 0.5))
    if lam < 0:
        return LINEAR
    # backward: zero where -lam <= x <= lam, grad elsewhere.
    return _mask(("outside", -lam, lam), 0.0, INF)


def _pow(site: Site) -> Rule:
    return LINEAR if linear_power(site.param("exponent"), 2) else LOG  # backward 0, 1 or 2 * x: linear in x


def linear_power(exponent, highest: int) -> bool:
    """Whether ``exponent`` is a plain number (not a bool or a tensor) among 0 .. ``highest`` (2 at most)."""
    return isinstance(exponent, int | float) and not isinstance(exponent, bool) and exponent in (0, 1, 2)[: highest + 1]


def _mul(site: Site) -> Rule:
    return FACTOR if site.broadcast else LINEAR


def _reduce(site: Site) -> Rule:
    reduce = site.param("reduce")
    if reduce in ("amax", "amin"):
        return EQUALITY
    return LOG if reduce == "prod" else LINEAR


def _norm(site: Site) -> Rule:
    ord_ = site.param("ord", 2)
    if isinstance(ord_, int | float) and math.isinf(ord_):
        return EQUALITY
    return LOG if site.role == "result" else LINEAR  # backward divides by the norm


def _attention(site: Site) -> Rule:
    if site.role in ("query", "key"):
        return LOGITS
    if site.role in ("value", "output"):
        return ATTENTION
    if site.role in ("logsumexp", "log_sumexp", "attn_mask", "attn_bias"):
        return LOG
    return LINEAR


# Normalisations that save their input and, as results 1 and 2, each row's mean and reciprocal deviation.
_NORMALISATION = (
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "cudnn_batch_norm",
    "miopen_batch_norm",
)

# (op, role) -> rule or function of the site; role None: any role of the op.
_TABLE: dict[tuple[str, str | None], object] = {
    # threshold and sign: masks
    ("relu", "result"): _mask(("gt", 0.0), 0.0, 1.0),
    ("relu_", "result"): _mask(("gt", 0.0), 0.0, 1.0),
    ("leaky_relu", "self"): _mask(("gt", 0.0), -1.0, 1.0),
    ("leaky_relu_", "result"): _mask(("gt", 0.0), -1.0, 1.0),
    ("threshold", "self"): lambda s: _mask(("gt", float(s.param("threshold", 0.0))), -INF, INF),
    ("hardtanh", "self"): _hardtanh,
    ("hardtanh_", "result"): _hardtanh,
    ("clamp", "self"): _clamp,
    ("clamp_min", "self"): lambda s: _clamp(Site(s.op, s.overload, s.role, (("min", s.param("min")),))),
    ("clamp_max", "self"): lambda s: _clamp(Site(s.op, s.overload, s.role, (("max", s.param("max")),))),
    ("hardsigmoid", "self"): _mask(("open", -3.0, 3.0), -INF, 0.0),
    ("hardshrink", "self"): _shrink,
    ("softshrink", "self"): _shrink,
    ("abs", "self"): Rule("threshold", "sign"),
    # values unused by backward
    ("max_pool2d_with_indices", "self"): UNUSED,
    ("max_pool3d_with_indices", "self"): UNUSED,
    ("adaptive_max_pool2d", "self"): UNUSED,
    ("adaptive_max_pool3d", "self"): UNUSED,
    ("avg_pool2d", "self"): UNUSED,
    ("avg_pool3d", "self"): UNUSED,
    ("_adaptive_avg_pool2d", "self"): UNUSED,
    ("_adaptive_avg_pool3d", "self"): UNUSED,
    # smooth activations: FewBit codes
    ("gelu", "self"): lambda s: _smooth("gelu", (("approximate", s.param("approximate", "none")),)),
    ("silu", "self"): _smooth("silu"),
    ("mish", "self"): _smooth("mish"),
    ("elu", "self"): lambda s: _smooth(
        "elu", tuple((k, float(s.param(k, 1.0))) for k in ("alpha", "scale", "input_scale"))
    ),
    ("celu", "self"): lambda s: _smooth("celu", (("alpha", float(s.param("alpha", 1.0))),)),
    ("softplus", "self"): lambda s: _smooth(
        "softplus", (("beta", float(s.param("beta", 1.0))), ("threshold", float(s.param("threshold", 20.0))))
    ),
    ("hardswish", "self"): _smooth("hardswish"),
    ("sigmoid", "result"): _smooth("sigmoid"),
    ("tanh", "result"): _smooth("tanh"),
    # attention
    ("_softmax", "result"): ATTENTION,
    ("_safe_softmax", "result"): ATTENTION,
    ("exp", "result"): ATTENTION,  # unnormalised probabilities; a group's values span orders of magnitude
    ("_scaled_dot_product_flash_attention_for_cpu", None): _attention,
    ("_scaled_dot_product_flash_attention", None): _attention,
    ("_scaled_dot_product_efficient_attention", None): _attention,
    ("_scaled_dot_product_cudnn_attention", None): _attention,
    # broadcast factors
    ("mul", "self"): _mul,
    ("mul", "other"): _mul,
    # equality
    ("amax", None): EQUALITY,
    ("amin", None): EQUALITY,
    ("max", None): EQUALITY,
    ("min", None): EQUALITY,
    ("maximum", None): EQUALITY,
    ("minimum", None): EQUALITY,
    ("fmax", None): EQUALITY,
    ("fmin", None): EQUALITY,
    ("scatter_reduce", None): _reduce,
    ("index_reduce", None): _reduce,
    ("linalg_vector_norm", None): _norm,
    ("norm", None): _norm,
    # reciprocal and log domain
    ("sqrt", "result"): LOG,
    ("rsqrt", "result"): LOG,
    ("reciprocal", "result"): LOG,
    ("log", "self"): LOG,
    ("log1p", "self"): LOG,
    ("log2", "self"): LOG,
    ("log10", "self"): LOG,
    ("div", "other"): LOG,
    ("div_", "other"): LOG,
    ("pow", None): _pow,
    ("logsumexp", None): LOG,
    ("_log_softmax", "result"): LOG,
    ("_ctc_loss", None): LOG,
    ("ctc_loss", None): LOG,
    ("prod", None): LOG,
    ("cumprod", None): LOG,
    ("std", "result"): LOG,
    ("log_sigmoid_forward", None): LOG,
    ("atan2", None): LOG,
    ("binary_cross_entropy", "self"): LOG,
    ("binary_cross_entropy_with_logits", "self"): LOG,
    ("_cdist_forward", "result"): LOG,
    # normalisation statistics (mean, reciprocal deviation)
    **{(op, role): STATISTICS for op in _NORMALISATION for role in ("result1", "result2")},
}

# Saved outputs name their op through their grad_fn, even where the op was not watched: node -> op.
_OUTPUT_NODES = {
    node: Site(op, role="result", result=True)
    for node, op in {
        "ReluBackward0": "relu",
        "ReluBackward1": "relu_",
        "LeakyReluBackward1": "leaky_relu_",
        "SigmoidBackward0": "sigmoid",
        "TanhBackward0": "tanh",
        "SoftmaxBackward0": "_softmax",
        "ExpBackward0": "exp",
        "SafeSoftmaxBackward0": "_safe_softmax",
        "LogSoftmaxBackward0": "_log_softmax",
        "SqrtBackward0": "sqrt",
        "RsqrtBackward0": "rsqrt",
        "ReciprocalBackward0": "reciprocal",
        "LogsumexpBackward0": "logsumexp",
        "AmaxBackward0": "amax",
        "AminBackward0": "amin",
        "MaxBackward1": "max",
        "MinBackward1": "min",
    }.items()
}


def rule_for(site: Site) -> Rule:
    """The rule of a save at ``site`` (``LINEAR`` for ops the table does not name)."""
    entry = _TABLE.get((site.op, site.role)) or _TABLE.get((site.op, None))
    if entry is None and site.op.endswith("_") and not site.op.endswith("__"):
        # an in-place variant not named in the table (scatter_reduce_): the rule of its op, for any role
        entry = _TABLE.get((site.op[:-1], None))
    if entry is None:
        return LINEAR
    if site.op == "clamp" and site.overload != "default":
        return EQUALITY  # clamp.Tensor: tensor bounds, compared in backward
    return entry(site) if callable(entry) else entry


def graph_result_rule(op: str) -> Rule | None:
    """The rule of a value made by ``op`` in a compiled graph, where the table gives one that a graph can store: kept
    (equality, log domain) for an op whose result or every save the table keeps, attention for a softmax or exp
    result; else ``None``. A graph has decomposed the ops whose rules need their own test or function (masks, FewBit
    codes), and the op's scalar arguments are not read (``pow``, norms and reductions: ``None``)."""
    entry = _TABLE.get((op, "result")) or _TABLE.get((op, None))
    return entry if isinstance(entry, Rule) and (entry.kind == "keep" or entry is ATTENTION) else None


# Matrix products: op -> its two matrix operands, by argument name. ``linear`` and ``matmul`` are composite (they
# reach the dispatcher as ``addmm``/``mm``/``bmm``/``mv`` of views), named here for a mode that sees them whole.
_MATRIX_OPERANDS = {
    "mm": ("self", "mat2"),
    "addmm": ("mat1", "mat2"),
    "bmm": ("self", "mat2"),
    "baddbmm": ("batch1", "batch2"),
    "addbmm": ("batch1", "batch2"),
    "mv": ("self", "vec"),
    "addmv": ("mat", "vec"),
    "matmul": ("self", "other"),
    "linear": ("input", "weight"),
}


def matrix_partner(op: str, role: str) -> str | None:
    """The argument name of the other matrix operand when ``role`` is one of ``op``'s two (``addmm``'s ``mat1``:
    ``mat2``), else ``None`` (``addmm``'s bias, any argument of a non-product)."""
    pair = _MATRIX_OPERANDS.get(op)
    if pair is None or role not in pair:
        return None
    return pair[1] if role == pair[0] else pair[0]


# Ops whose backward reads an activation operand only for the weight's gradient, beyond the matrix products: a
# convolution's input gradient is the transposed convolution of the output gradient with the weight.
_WEIGHT_READERS = {"convolution": ("input", "weight")}


def weight_partner(op: str, role: str) -> str | None:
    """The weight operand's name of a save passed as ``role`` to ``op``, where backward reads that save only for the
    weight's gradient (a matrix product's other operand, a convolution's weight), else ``None``."""
    pair = _WEIGHT_READERS.get(op)
    if pair is not None and role == pair[0]:
        return pair[1]
    return matrix_partner(op, role)


def weight_only(site: Site) -> bool:
    """Whether backward reads the save at ``site`` only for a weight's gradient, linearly: the activation operand of
    a matrix product or a convolution whose other operand is a weight. Its noise then reaches that gradient alone
    (the sensitivity estimator probes such saves together)."""
    return site.weight_operand and not site.result and weight_partner(site.op, site.role) is not None


def sketchable(site: Site) -> bool:
    """Whether the save at ``site`` may be stored as a row sketch (``gactx.kernels.schemes.sketch``): it is a matrix
    operand of a product whose other operand is a weight, so backward reads it only for the weight's gradient,
    linearly. A result save, a product of two activations, or any other op: ``False``."""
    return site.weight_operand and not site.result and matrix_partner(site.op, site.role) is not None


def curved(site: Site) -> bool:
    """Whether the save at ``site`` is the input of a normalisation, whose backward normalises it again: its
    gradient's variance grows with the square of the stored error as well as with the error (module docstring)."""
    return site.op in _NORMALISATION and site.role == "input"


def node_id(fn) -> int:
    """An autograd node's identity for one forward pass: its sequence number, which the node keeps. Not
    ``id(fn)``: ``grad_fn`` is a Python wrapper that some torch versions make afresh at each access once the
    last one is freed, so one node can show two ids. Two threads number their nodes apart, so two nodes may
    share a number; that can only make a result save look like an input save (quantized as linear)."""
    return fn._sequence_nr()


def output_rule(t: torch.Tensor, claimed: set[int]) -> tuple[Site, Rule] | None:
    """The site and rule of a result saved by its own op, read from its ``grad_fn`` (no watcher needed), or
    ``None``. Autograd saves a node's result right after making the node, before anything else can save
    that tensor, so the first save of a tensor whose node saves its result is that save; ``claimed``
    (:func:`node_id` of nodes, one forward pass) marks the nodes whose result save has been seen. A shared
    number can only make a result save look like an input save, which is then quantized as linear: never
    the other way round."""
    fn = t.grad_fn
    if fn is None:
        return None
    site = _OUTPUT_NODES.get(type(fn).__name__)
    if site is None or node_id(fn) in claimed:
        return None
    claimed.add(node_id(fn))
    return site, rule_for(site)
