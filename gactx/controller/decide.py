"""One decision a saved tensor: which rule stores it and at what width, for eager and compiled saves alike.

The eager pack path (``pack.py``) finds a save's rule from its site (``rules.rule_for``: the op watcher, what was
learned for its slot, or a result's ``grad_fn``); the compiled path (``compiled.py``) from the graph node it is shown
(:func:`node_rule`: the same op table, read through the node's op and how the backward graph uses it). Both then
call :func:`decide`, which reads the width from the plan (``plan.py``: by slot, or by a compiled graph's modules and
shape) and returns a :class:`Decision`; the record of the save (``stats.KeyRecord``) copies its fields::

    decision = decide(t, rule, plan, slot, config)   # Decision(rule, bits, choice, reason)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gactx.config import Config
from gactx.controller.adaptation.choices import Choice
from gactx.controller.graph_nodes import PASS_THROUGH, op_name, source
from gactx.controller.identity import Slot
from gactx.controller.plan import GraphSlot, Plan
from gactx.controller.rules import (
    ALLOCATED,
    ATTENTION,
    CHECKPOINT_INPUT,
    EQUALITY,
    FACTOR,
    LINEAR,
    LOG,
    LOGITS,
    MIN_BITS,
    PROVENANCE,
    Rule,
    Site,
    graph_result_rule,
    linear_power,
    sketchable,
)
from gactx.controller.stats import AS_IS, EXACT
from gactx.kernels.format import as_is_width

__all__ = ["BOOL_MASK", "Decision", "decide", "kept", "may_share", "node_rule"]

BOOL_MASK = Rule("bool mask", "quantize")  # bool tensors: 1 bit an element, lossless, whatever the width


@dataclass(frozen=True, slots=True)
class Decision:
    """What a save becomes. ``rule``: the op rule that stores it (``None``: kept before any rule applied, by the
    policy: small, an integer dtype, level L0); ``bits``: its width (``None`` where it has none: a rule that keeps
    or stores losslessly at its own width, a tensor the policy keeps); ``choice``: the scheme the allocation chose
    where not uniform codes; ``reason``: why it is kept as it is, ``""`` where it is stored; ``seed``: the noise seed
    of a quantized save (the plan's, :meth:`Plan.seed`; 0 where nothing is drawn)."""

    rule: Rule | None
    bits: int | None = None
    choice: Choice | None = None
    reason: str = ""
    seed: int = 0

    @property
    def cls(self) -> str:
        return "" if self.rule is None else self.rule.cls


_KEPT: dict[str, Decision] = {}


def kept(reason: str) -> Decision:
    """The decision to keep a tensor as it is before any rule applies (``reason``: the policy's, or ``"L0"``)."""
    found = _KEPT.get(reason)
    if found is None:
        found = _KEPT[reason] = Decision(None, None, None, reason)
    return found


_BOOL = Decision(BOOL_MASK, 1)
_BY_RULE: dict[Rule, Decision] = {}  # a class the allocator does not serve: one decision for its rule


def decide(
    t: torch.Tensor, rule: Rule, plan: Plan, slot: Slot | GraphSlot, config: Config, number: int = 0
) -> Decision:
    """The decision for ``t``, saved under ``rule`` in ``slot`` (``number``: the save's, as the pack path numbers
    them, for its noise seed): 1 bit for a bool mask, the level's ``checkpoint_bits`` for a checkpointed region's
    input, the plan's width for an allocated class (at least the class's ``MIN_BITS``; a uniformly quantized
    one, whatever its class, where the sensitivity probe perturbs the slot), else the rule's own form; any save a probe
    pass that keeps what it does not perturb exact does not perturb, as it is."""
    if plan.exact and slot not in plan.probe:  # a probe pass against the exact base: what it does not probe, as it is
        return Decision(rule, None, None, EXACT)
    if rule is BOOL_MASK:
        return _BOOL
    if rule is CHECKPOINT_INPUT:
        bits = config.checkpoint_bits
        if bits is None:
            return Decision(rule, None, None, "checkpoint_bits=None")
        if as_is_width(bits, t.dtype):
            return Decision(rule, bits, None, AS_IS)
        return Decision(rule, bits, None, "", plan.seed(slot, number))
    if rule.cls not in ALLOCATED:
        found = _BY_RULE.get(rule)
        if found is None:
            found = _BY_RULE[rule] = Decision(rule, None, None, "kept" if rule.kind == "keep" else "")
        return found
    bits, choice, probing = plan.width(slot)
    if probing:
        rule = LINEAR  # the probe's choice, if it measures one
    elif rule.kind != "quantize":
        choice = None
    elif bits < MIN_BITS.get(rule.cls, 0):
        bits = MIN_BITS[rule.cls]
    if choice is None and rule.kind == "quantize" and as_is_width(bits, t.dtype):
        return Decision(rule, bits, None, AS_IS)
    return Decision(rule, bits, choice, "", 0 if type(slot) is GraphSlot else plan.seed(slot, number))


def may_share(first: Decision, later: Decision, site: Site | None) -> bool:
    """Whether a later save of a tensor (decided ``later``, at ``site``) may share what a first save of it stored under
    ``first``: not a row sketch unless this save too only feeds a weight's gradient, not codes narrower than an
    attention class allows (such a save stores its own)."""
    choice, bits = first.choice, first.bits
    if choice is not None and choice.scheme == "sketch" and (site is None or not sketchable(site)):
        return False
    return bits is None or bits >= MIN_BITS.get(later.rule.cls, 0)


# -- compiled graphs: the rule of a saved node --------------------------------------------------------------

# How the backward graph uses a saved value where its exact value matters ("equality" and "log domain" in the ops a
# graph decomposes to): the op of the user -> the rule.
_EXACT_USERS = {"eq": EQUALITY, "ne": EQUALITY, **dict.fromkeys(
    ("log", "log1p", "log2", "log10", "reciprocal", "rsqrt", "sqrt", "pow", "atan2"), LOG
)}  # fmt: skip


def node_rule(node, bw_graph) -> Rule:
    """The rule of a floating-point saved node of a compiled graph: the op table's (``rules.graph_result_rule``) for
    the op that made its values; else kept where the backward graph reads its exact value, attention where the value
    is a quotient of an exp result (a decomposed softmax) or a fused attention's value or output, attention logits
    where backward recomputes an exp from it (a fused attention's query and key, a decomposed softmax's scores), kept
    as a broadcast factor where backward multiplies it into something larger; else linear. The rules
    that need the op's own test or function (masks, FewBit codes, pooling inputs) are eager-only: a graph decomposes
    those ops, and one saved node serves every backward use of the value."""
    made = source(node)
    found = graph_result_rule(op_name(made))
    if found is not None and found.kind == "keep":
        return found
    exact = _exact_use(node, bw_graph)
    if exact is not None:
        return exact
    if found is not None:
        return found
    if op_name(made) == "div" and made.args and isinstance(made.args[0], torch.fx.Node):
        if op_name(source(made.args[0])) == "exp":
            return PROVENANCE["probabilities"]
    role = _sdpa_role(node, bw_graph)
    if role in ("value", "out"):
        return ATTENTION
    if role in ("query", "key") or _feeds_exp(node, bw_graph):
        return LOGITS
    return FACTOR if _broadcast_factor(node, bw_graph) else LINEAR


def _exact_use(node, bw_graph) -> Rule | None:
    p = _placeholder(node, bw_graph)
    for user in () if p is None else p.users:
        rule = _EXACT_USERS.get(op_name(user))
        if rule is not None and not _linear_power(user, p):
            return rule
        if op_name(user) == "div" and len(user.args) > 1 and user.args[1] is p:
            return LOG
    return None


def _linear_power(user, value) -> bool:
    """Whether ``user`` is ``value ** 0`` or ``value ** 1``: what the backward of ``x ** 1`` and ``x ** 2`` reads of
    ``x`` (an RMSNorm's ``x.pow(2)``), linear in it, as the eager rule of ``pow`` has it (``rules._pow``)."""
    return op_name(user) == "pow" and len(user.args) > 1 and user.args[0] is value and linear_power(user.args[1], 1)


def _placeholder(node, bw_graph):
    """The backward graph's placeholder for the saved ``node`` (by name), or ``None``."""
    return next((p for p in bw_graph.find_nodes(op="placeholder") if p.name == node.name), None)


def _sdpa_role(node, bw_graph) -> str | None:
    """The argument the value is passed as to a fused attention's backward (``_scaled_dot_product_*_backward``:
    ``query`` and ``key``, the eager rule's ``attention logits``; ``value`` and ``out``, its ``attention``), else
    ``None``."""
    p = _placeholder(node, bw_graph)
    for user in () if p is None else p.users:
        if op_name(user).startswith("_scaled_dot_product") and hasattr(user.target, "_schema"):
            for arg, value in zip(user.target._schema.arguments, user.args, strict=False):
                if value is p:
                    return arg.name
    return None


def _broadcast_factor(node, bw_graph) -> bool:
    """Whether backward multiplies the value element-wise into something with more elements and does not sum that
    product (the eager rule's ``broadcast factor``: a product's operand broadcast against the other, whose gradient is
    the product's, not an outer product's sum)."""
    p = _placeholder(node, bw_graph)
    val = None if p is None else p.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    frontier = [p]  # through views and the element-wise functions a graph recomputes from it (cos and sin of angles)
    for _ in range(3):
        users = [u for n in frontier for u in n.users]
        for user in users:
            out = user.meta.get("val")
            if op_name(user) == "mul" and isinstance(out, torch.Tensor) and out.numel() > val.numel():
                if not any(op_name(u) in ("sum", "mean") for u in user.users):
                    return True
        frontier = [u for u in users if op_name(u) in ("cos", "sin", "neg", *PASS_THROUGH)]
    return False


def _feeds_exp(node, bw_graph) -> bool:
    """Whether backward recomputes an ``exp`` from the value (a softmax the partitioner chose to recompute from
    its scores, the max subtracted or a scale applied first): noise in it is multiplied by the exp."""
    p = _placeholder(node, bw_graph)
    frontier = [] if p is None else [p]
    for _ in range(3):
        users = [u for n in frontier for u in n.users]
        if any(op_name(u) == "exp" for u in users):
            return True
        frontier = [u for u in users if op_name(u) in ("sub", "add", "mul", "div", "where", *PASS_THROUGH)]
    return False
