"""How much each saved tensor's compression perturbs the gradient: GACT's sensitivity estimator.

For every compressed tensor ``l`` (named by its slot: module, call, index) the user's ``backprop`` closure runs once
with ``l`` quantized at ``probe_bits`` and every other tensor stored as it is (:data:`EXACT_BASE`), against one base
pass that stores every tensor as it is (its gradients are plain PyTorch's, bit for bit). The two parameter gradients
differ by ``l``'s noise alone, so::

    C_l = ||g_l - g_base||^2 / S(probe_bits)

That is ``2 + L`` passes for ``L`` tensors (one pass finds the tensors, one is the base), and one more for each
storage choice whose effect on the gradient is measured rather than predicted (a row sketch: ``choices.py``). Whatever
the op's backward, ``||g_l - g_base||^2`` is what ``l`` alone adds to the gradient's squared error: its variance, and
the square of any bias its rounding puts into the gradient's mean. Tensors whose noise reaches only their own weights'
gradients are probed all at once (``together.py``). Every other measurement (a tensor at a width, a storage
choice) is made for several tensors at once where the estimate knows where each one's noise lands in the gradient and
those places overlap little (``groups.py``). The passes after the first two replay the second's backward calls, its
forward run once, from the nodes that read what a pass probes down (``replayed.py``); normalisation inputs measured
alone whose noise passes one node (a residual block's input: ``cuts.py``) share the backward below it, each one's part
there read as the largest one's, scaled (``passes.CUTS``). The first pass stores every tensor as training does; how far
its gradients are from the base's, over what the estimate predicts for it, is :attr:`Estimate.unexplained` (about 1
where the tensors' noises add; the estimator measures with the others at their widths where they interact).

With :data:`EXACT_BASE` off, every pass stores the other tensors at their widths, with the same noise, and ``l`` is
quantized at ``probe_bits`` with two different seeds: ``C_l = 1/2 * ||g_a - g_b||^2 / S(probe_bits)``, ``1 + 2 L``
passes. A tensor whose op's backward is linear in it and whose stored noise in these passes is known (``context_of``:
``S(b)`` of uniform codes at ``b`` bits, 0 where it is stored as it is) takes one pass instead, against a base pass with
nothing probed: ``g - g_base = J (e_probe - e_context)``, so ``C_l = ||g - g_base||^2 / (S(probe_bits) + S(b))``
(:data:`BASE`). Any other tensor stored in a form a probe can store too (uniform codes, the normal scheme's) takes one
pass in that form against the base, whatever its op's backward: the base's draw of it is a pair's other draw
(:data:`STORED_BASE`).

GACT's model, ``C_l S(b)``, holds where backward is linear in the saved tensor. The input of a normalisation is
read twice over (``rules.curved``): its gradient variance is ``C_lin S(b) + Q S(b)**2``, and on a BERT layer the
quadratic part makes the 1-bit variance 10 times what the 2-bit probe extrapolates and the 4-bit one a tenth of it.
Such a tensor is probed at two widths, a pass each against the base (or a pair, ``curves.py``), ``C_lin`` and
``Q`` are fitted through the two, and its ``C`` is the fit's variance at ``probe_bits`` over ``S(probe_bits)``;
:attr:`Estimate.curves` hands the shape to the allocator. Around them, the
estimator saves and restores the RNG states (CPU and CUDA: dropout draws the same masks in every pass, and training
continues with the stream it had), the model's buffers (BatchNorm running statistics, batch counters)
and every parameter's ``.grad``. Parameters are never written: the closure runs forward and backward only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from gactx.controller.adaptation import replayed
from gactx.controller.adaptation.curves import CURVE_WIDTHS, fit_curve, partner
from gactx.controller.adaptation.groups import Profiles, Weights, layout_of, parts, smallest
from gactx.controller.adaptation.passes import Passes
from gactx.controller.adaptation.probe import Probe
from gactx.controller.adaptation.ranks import distributed, mean_over_ranks
from gactx.controller.adaptation.together import probe_together, weight_blocks
from gactx.controller.adaptation.widths import variance_factor

__all__ = ["Probe", "Estimate", "ModelSnapshot", "PARTS", "estimate_sensitivities"]

# Sensitivities legitimately span orders of magnitude (first layers vs last); one that is not finite, or
# more than a million times the median, is a blown-up pass and is capped there, so that it cannot make the
# allocator starve every other tensor.
CAP_FACTOR = 1e6
# Probe a tensor whose stored noise in the pass is known in one pass against a shared base pass, not a pair (see
# estimate_sensitivities); False: every tensor by pairs.
BASE = True
# A slot stored when nothing is probed in a form a probe can store too (uniform codes, the normal scheme's; any class)
# is probed in one pass against the base, in that form, not by a pair (estimate_sensitivities' ``stored_of``); False:
# a pair.
STORED_BASE = True
# Every probe pass stores the tensors it does not probe as they are, and every measurement is one pass against a base
# pass that stores every tensor as it is: ``D = ||g - g_exact||^2`` is what the probed tensor alone adds to the
# gradient's squared error (its variance, and any bias), whatever its op's backward, so no measurement needs a pair, no
# pass pays for the other tensors' kernels, and an estimate does not depend on how the others are stored (the first
# adaptation estimates once). False: the others at their widths, pairs where the base's draw is not a pair's other
# one (BASE, STORED_BASE).
EXACT_BASE = True
# Tensors are negligible where they are the smallest whose variances at 1 bit sum to at most this share of every
# tensor's variance at the probe width: whatever width each is given, together they add less than that to the
# gradient's variance. A curve's second width is left unmeasured where its tensor is negligible so (_negligible), and
# it is read on the line through its first width (which overrates it at wider widths); against every tensor's at its
# first width instead, a ViT-B/16's error rose 11%. Negligible tensors measured against the base at the probe width
# whose sensitivity and profile an estimate knows (a later one) are measured together, in one pass
# (passes.Passes.measure); against the probe width's total instead of the 1-bit one, the zoo transformer layer's later
# allocation erred 1.10x. 0: neither.
NEGLIGIBLE = 0.01
# What Estimate.parts calls each kind of measurement (besides "discovery" and "base", a pass each).
PARTS = {"together": "linear inputs together", "one": "against the base", "width": "by pairs",
         "curves": "curve widths", "choice": "calibration pairs"}  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    sensitivity: dict  # slot -> C
    passes: int
    seconds: float
    probed: dict = field(default_factory=dict)  # slot -> {choice: the gradient variance it adds, measured}
    # slot -> (a, q): the gradient variance of a curved tensor at S-equivalent x is C (a x + q x**2) (fit_curve)
    curves: dict = field(default_factory=dict)
    # slot -> rho: a LayerNorm input's normalized noise at S(b) = 1 over its values' variance (ActNN's estimator)
    ratios: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)  # slot -> {choice: its stored error} (choices.ChoiceMeter)
    profiles: Profiles | None = None  # where each probed tensor's noise landed in the gradient (groups.py)
    parts: dict = field(default_factory=dict)  # where the passes went: part -> (measurements, passes) (PARTS)
    # the first pass's squared distance from the exact base over what the estimate predicts for it (_unexplained)
    unexplained: float | None = None
    partial: int = 0  # of the passes, those that ran backward from the probed nodes down (replayed.PARTIAL)


class ModelSnapshot:
    """RNG states, buffers and gradients of a model, to put back exactly as they were. The gradients are kept as they
    are, not copied: every pass of an estimate sets each ``.grad`` to ``None`` before it runs, so none writes into them
    (a copy was one more set of the trainable parameters' size in the adaptation's peak). Under ``torch.distributed``
    they are copied: a reducer may hand its buckets out as the gradients (DDP's ``gradient_as_bucket_view``) and write
    them again in the next backward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.buffers = [b.detach().clone() for b in model.buffers()]
        copy = distributed()
        self.grads = [
            None if p.grad is None else p.grad.detach().clone() if copy else p.grad for p in model.parameters()
        ]

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        self.restore_rng()
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self.buffers, strict=True):
                b.copy_(saved)
        for p, g in zip(self.model.parameters(), self.grads, strict=True):
            p.grad = g


def _gradient(model: nn.Module, backprop: Callable[[], object], snapshot: ModelSnapshot) -> list[torch.Tensor]:
    """The parameters' gradients of one run of ``backprop`` from the snapshot's RNG state: those that have one, in
    ``model.parameters()`` order (the estimate's layout, ``groups.layout_of``). The tensors themselves, not a copy: the
    next pass sets each ``.grad`` to ``None`` and leaves them as they are (a flat float64 copy would cost a large part
    of each pass)."""
    snapshot.restore_rng()
    for p in model.parameters():
        p.grad = None
    backprop()
    return [p.grad.detach() for p in model.parameters() if p.grad is not None]


def estimate_sensitivities(
    model: nn.Module,
    backprop: Callable[[], object],
    discover: Callable[[Callable[[], object]], list],
    set_probe: Callable[[Probe | None], None],
    probe_bits: int,
    seed_of: Callable[[Hashable, int], int],
    progress: Callable[[int, int], None] | None = None,
    choices_of: Callable[[Hashable], tuple] | None = None,
    curved: Callable[[Hashable], bool] | None = None,
    weights_of: Callable[[Hashable], tuple] | None = None,
    context_of: Callable[[Hashable], float | None] | None = None,
    stored_of: Callable[[Hashable], tuple[int, object, float] | None] | None = None,
    shape_of: Callable[[Hashable], tuple[float, float] | None] | None = None,
    profiles: Profiles | None = None,
    exact: bool | None = None,
    noise_of: Callable[[Hashable], float] | None = None,
    defer: Callable[[bool], None] | None = None,
    allocated: float | None = None,
    trained: Callable[[], dict | None] | None = None,
    weighing: Weights | None = None,
) -> Estimate:
    """Run GACT's estimator. ``discover(run)`` runs one pass and returns the slots it compressed;
    ``set_probe`` tells the controller which tensor to perturb; ``seed_of(slot, k)`` gives probe seeds;
    ``progress(done, total)`` is told the passes run so far, and those the estimate plans so far, before each pass
    (the plan changes as measurements come in: ``estimators.ProgressLog``).
    ``choices_of(slot)``: pairs of storage
    choices whose stored values average to the tensor (a row sketch and its complement, one seed); the gradient
    variance of the first, a quarter of the two gradients' squared distance, is measured too, two more passes a pair
    (``Estimate.probed``). ``curved(slot)``: the slot is probed at ``curves.CURVE_WIDTHS`` instead of ``probe_bits``.
    ``weights_of(slot)``: the parameters whose gradients alone the slot's noise reaches (the weights of the products it
    is an operand of), or ``()``; such slots are probed together (``together.py``). ``context_of(slot)``: the
    variance, in units of ``S(b)``, of what the slot stores when nothing is probed (``S(b)`` of uniform codes at ``b``
    bits, 0 where it is stored as it is), or ``None`` where that is not known (another scheme): a slot probed at one
    width whose context is known takes one pass, against a base pass of the context (:data:`BASE`), not a pair.
    ``stored_of(slot)``: how the slot is stored when nothing is probed, ``(bits, choice, x)`` (``choice`` ``None`` for
    uniform codes, else the normal scheme's; ``x`` its noise in units of ``S(b)``), or ``None`` (a form a probe cannot
    store: FewBit codes, a sketch). Whatever its op's backward, the slot is then probed in that form against the base
    instead of a pair: the base's draw of the tensor is the pair's other draw, from the same distribution, so the
    gradient's mean does not move between them and ``||g - g_base||^2`` is twice the variance ``v`` there, as a pair's
    is. A slot probed at one width gets ``C = v / (a x + q x**2)``, ``(a, q)`` its curve's shape (``shape_of(slot)``, a
    normalisation input's kept curve) or ``(1, 0)``; one whose curve is fitted at two widths takes that pass where a
    width is the one its uniform codes have. ``profiles``: the last estimate's (:attr:`Estimate.profiles`); a slot
    whose profile is known, kept or measured earlier in this estimate, is measured in groups (``groups.py``).
    ``exact``: every probe pass stores what it does not probe as it is (:data:`EXACT_BASE` where ``None``);
    ``context_of`` and ``stored_of`` then go unread, and ``noise_of(slot)``, the noise in units of ``S`` of what the
    first pass stored for the slot, gives :attr:`Estimate.unexplained`; ``defer(on)`` puts the pack path's plan in and
    out of deferring (``Plan.deferred``), where the passes after the first replay the closure's backward
    (``replayed.py``). ``allocated``: the gradient variance the allocation in force predicts, where there is one: the
    tensors of one-pass measurements whose variances at 1 bit sum to at most :data:`NEGLIGIBLE` of it are measured
    together, in one pass (``passes.Passes.measure``). ``trained()``: where ``discover`` returned without running its
    pass, the probes that store each slot as training does; the first pass is then a replay of the base's forward
    under them (``gact_estimator.REPLAY_FIRST``), ``None`` where there is none. ``weighing``: where relative, each
    parameter's part of every squared distance is weighed by how small its gradient is (``groups.Weights``: the
    objective ``"update"``), so that the sensitivities are of the error each parameter's own step sees; its vector is
    the base pass's where it has none (the estimate's first pass, not the discovering one: that one's tensors all
    carry training's noise). ``None``: the squared distances as they are."""
    start = time.perf_counter()
    exact = EXACT_BASE if exact is None else exact
    snapshot = ModelSnapshot(model)
    first: list = []  # the first pass's gradient (every tensor as training stores it), then its distance from the base
    weighing = Weights(relative=False) if weighing is None else weighing
    try:
        slots = discover(lambda: first.append(_gradient(model, backprop, snapshot)))
        if exact and defer is not None and replayed.REPLAY and not distributed():  # DDP, FSDP: a forward each
            backprop = replayed.Replayed(model, backprop, defer)
        layout, sizes = layout_of(model)
        plans = {
            slot: (
                CURVE_WIDTHS if curved is not None and curved(slot) else (probe_bits,),
                choices_of(slot) if choices_of is not None else (),
            )
            for slot in slots
        }
        if exact:  # every slot at one width against the exact base, its context nothing
            context = {s: 0.0 for s in slots if len(plans[s][0]) == 1}
            single, based = set(context), {}
        else:  # a slot probed at one width whose context is known: one pass against the base (BASE), else a pair
            context = {s: context_of(s) for s in slots} if BASE and context_of is not None else {}
            single = {s for s in slots if plans[s][0] == (probe_bits,) and context.get(s) is not None}
            # Else the form it is stored in when nothing is probed, where a probe can store it so: against the base.
            stored = {s: stored_of(s) for s in slots if s not in single} if BASE and STORED_BASE and stored_of else {}
            based = {
                s: form for s, form in stored.items()
                if form is not None and (len(plans[s][0]) == 1 or form[1] is None and form[0] in plans[s][0]
                                         or any(partner(form, w) is not None for w in plans[s][0]))
            }  # fmt: skip
        blocks = weight_blocks(
            model, {s: weights_of(s) for s in slots if plans[s][0] == (probe_bits,)} if weights_of else {}
        )
        together = len(blocks) > 1
        alone = bool(single) and all(s in single for s in blocks)  # the block's probe against the base too
        if not exact and (
            len(single - set(blocks) if together else single) + (together and alone) + len(set(based) - set(blocks)) < 2
        ):
            single, alone, based = set(), False, {}  # the base pass would save fewer passes than it costs
        passes = Passes(lambda: _gradient(model, backprop, snapshot), set_probe, sizes, progress, weighing)
        each = 1 if alone else 2  # passes a measurement of the block: against the base, or a pair
        planned = each + (each if exact else 2) * max(len(plans[s][1]) for s in blocks) if together else 0
        measures = _measures(
            {s: plans[s] for s in plans if not (together and s in blocks)}, single, based, context, probe_bits,
            seed_of, shape_of, exact,
        )  # fmt: skip
        based_on = exact or bool(single or based)  # a base pass (exact: every measurement is against it)
        passes.total = 1 + (1 if based_on else 0) + planned
        passes.total += sum((1 if m[1] is None else 2) for row in measures.values() for m in row.values())
        if based_on:  # every tensor stored as when nothing is probed, or as it is (exact)
            passes.base = passes.gradient({} if exact else None)
            passes.spent("base", 0, 1)
            if isinstance(backprop, replayed.Replayed):  # a probe pass from the nodes it perturbs, where it can
                params = [p for p in model.parameters() if p.grad is not None]
                if len(params) == len(sizes):
                    passes.difference = lambda probes: backprop.difference(probes, set_probe, params)
                    passes.expect = backprop.expect
                    passes.cut_of = lambda slot: backprop.cut_of(slot, params)
                    passes.split = lambda slot, probe: backprop.split(slot, probe, set_probe, params)
                    passes.below = lambda slot, delta: backprop.below(slot, delta, params)
                    passes.curved = frozenset(
                        s for s in slots if curved is not None and curved(s) or shape_of is not None and shape_of(s)
                    )
            probes = trained() if trained is not None and not first else None
            if probes is not None:  # the first pass, every tensor as training stores it: a replay (not counted again)
                set_probe(probes)
                first.append(_gradient(model, backprop, snapshot))
            elif not first:  # no first pass at all: its replay left out (gact_estimator.RECHECK)
                passes.no_first()
            if first:  # the first pass's distance from the base, read now: its gradients are not held on
                first[0] = float(mean_over_ranks(parts(first[0], passes.base, weighing.vector)).sum())
        raw, probed, curves = {}, {}, {}
        if together:
            if passes.expect is not None:  # a window of given gradients holds the measurements' nodes after them
                passes.expect([*blocks, *(s for _, row in _in_order(measures) for s in row)])
            against = (passes.distance, {s: context[s] for s in blocks}) if alone and passes.base is not None else None
            joint, runs = probe_together(
                lambda: weighing.observe(_gradient(model, backprop, snapshot)),
                set_probe,
                plans,
                blocks,
                probe_bits,
                seed_of,
                against,
                exact,
                weighing,
            )
            passes.done += runs
            passes.total += runs - planned
            passes.spent(PARTS["together"], len(blocks), runs)
            if float(mean_over_ranks(torch.tensor([joint is not None], dtype=torch.float64))) < 1:
                joint = None  # every rank measures them as one did, or all run as many passes
            if joint is not None:
                raw.update(joint[0])
                probed.update(joint[1])
            else:  # what they reached is not what their weights say: each measured as the others are
                more = _measures(
                    {s: plans[s] for s in blocks}, single, based, context, probe_bits, seed_of, shape_of, exact
                )
                for what, row in more.items():
                    measures.setdefault(what, {}).update(row)
                passes.total += sum((1 if m[1] is None else 2) for row in more.values() for m in row.values())
        kept = profiles if profiles is not None and profiles.layout == layout else Profiles(layout)
        shares, measured, firsts = {}, {}, set()  # firsts: curves whose first width is measured
        # What negligible tensors measured at the probe width may be expected to put there together: their variances
        # at 1 bit (on the line) at most NEGLIGIBLE of the variance the allocation in force predicts.
        narrow = variance_factor(CURVE_WIDTHS[0]) / variance_factor(probe_bits)  # S at 1 bit over S at the probe's
        negligible = NEGLIGIBLE * allocated / narrow if allocated is not None and math.isfinite(allocated) else 0.0
        order = _in_order(measures)
        for n, (what, row) in enumerate(order):
            pending = firsts & row.keys() if what[0] == "width" else set()
            if pending:
                skipped = _negligible(pending, raw, narrow)
                row = {s: m for s, m in row.items() if s not in skipped}
                passes.total -= sum(1 if m[1] is None else 2 for s, m in measures[what].items() if s in skipped)
                if not row:
                    continue
            fitted = what[0] == "width" and any(len(plans[s][0]) > 1 for s in row)  # widths of curves
            found, fresh = passes.measure(
                row, kept, raw, shares, PARTS["curves" if fitted else what[0]], negligible if what == ("one",) else 0.0,
                [s for _, after in order[n + 1 :] for s in after],  # their nodes fill the window too
            )  # fmt: skip
            if what[0] != "choice":  # a sketch's noise is not the codes'
                shares.update(fresh)
            measured[what] = found
            for slot, d in found.items():
                if what == ("one",):
                    raw[slot] = d / row[slot][2] if row[slot][2] > 0 else math.inf
                elif what[0] == "width" and slot not in raw and row[slot][2] > 0:  # a curve's first width: what its
                    raw[slot] = d / row[slot][2]  # other width's measurement expects, until the fit replaces it
                    firsts.add(slot)
        variances, partners = {}, {}
        for what, found in measured.items():
            if what[0] == "width":
                for slot, d in found.items():
                    x = partner(based.get(slot), what[1]) if what[2] is None else None
                    paired = what[2] is not None or x is None and not exact  # D twice the variance
                    variances.setdefault(slot, {})[what[1]] = 0.5 * d if paired else d
                    if x is not None:
                        partners.setdefault(slot, {})[what[1]] = x
            elif what[0] == "choice":
                for slot, d in found.items():
                    v = d if exact else 0.25 * d  # against the exact base, or a pair (4 times the variance)
                    probed.setdefault(slot, {}).setdefault(plans[slot][1][what[1]][0], []).append(v)
        for slot, variance in variances.items():
            if len(variance) == 1:  # one width: the probe's, or a curve's first (the line through it, _negligible)
                ((bits, v),) = variance.items()
                raw[slot] = v / variance_factor(bits)
                if slot in firsts:
                    curves[slot] = (1.0, 0.0)  # kept as a fitted curve is: a later adaptation probes one width
            else:
                curves[slot], raw[slot] = fit_curve(variance, probe_bits, partners.get(slot))
        for slot, row in probed.items():  # a choice probed by several pairs (several seeds): their mean
            probed[slot] = {c: v if not isinstance(v, list) else sum(v) / len(v) for c, v in row.items()}
    finally:
        if isinstance(backprop, replayed.Replayed):
            backprop.close()
        set_probe(None)
        snapshot.restore()
    raw = {slot: raw[slot] for slot in plans}  # in the order the pass made them, however they were probed
    profiles = Profiles(
        layout,
        {**kept.shares, **shares},
        {**kept.sensitivity, **raw},
        dict(passes.rotated),
        frozenset(measured.get(("one",), ())),
    )
    capped = cap(raw)
    unexplained = None
    if exact and noise_of is not None and passes.base is not None and first:
        shape = (lambda s: curves.get(s) or shape_of(s)) if shape_of is not None else curves.get
        unexplained = _unexplained(first[0], capped, shape, noise_of)
    return Estimate(capped, passes.done, time.perf_counter() - start, probed, curves, profiles=profiles,
                    parts=passes.parts, unexplained=unexplained, partial=passes.partial)  # fmt: skip


def _in_order(measures: dict) -> list:
    """``measures`` (:func:`_measures`) as ``(what, row)`` in the order they are measured: the curves' second widths
    last, every other tensor measured before them."""
    last = CURVE_WIDTHS[-1]
    return sorted(measures.items(), key=lambda item: item[0][0] == "width" and item[0][1] == last)


def _unexplained(measured: float, sensitivity: dict, shape_of, noise_of) -> float:
    """How many times what the estimate predicts for its first pass (every tensor as training stores it), ``sum C (a
    x + q x**2)`` at each tensor's noise ``x`` there, its squared distance from the exact base, ``measured``, is:
    about 1 where the tensors' noises add (0.24 to 1.07 on 13 of the 15 models of ``benchmarks.schemes``, ``x``
    pricing every scheme as uniform codes at its width; ViT-B/16 35 at the first adaptation's uniform 2 bits), far
    more where they interact, one tensor's noise in the gradient that another's backward reads against its own (the
    zoo transformer layer, 8e5: its attention's weights get almost no gradient but what the other tensors' noise puts
    there)."""
    predicted = 0.0
    for slot, c in sensitivity.items():
        x = noise_of(slot)
        a, q = shape_of(slot) or (1.0, 0.0)
        predicted += c * (a * x + q * x * x)
    return measured / predicted if predicted > 0 else math.inf if measured > 0 else 1.0


def _negligible(pending: set, raw: dict, ratio: float) -> set:
    """The curves among ``pending`` whose second width is left unmeasured (:data:`NEGLIGIBLE`): the smallest, while
    their variances at their first width sum to at most that share of every tensor's measured so far at the probe
    width (``raw``: each one's variance per unit of ``S`` at the width it was measured at; ``ratio``: ``S`` at the
    curves' first width over ``S`` at the probe width)."""
    finite = {s: c for s, c in raw.items() if math.isfinite(c)}
    return set(smallest({s: finite[s] for s in pending if s in finite}, NEGLIGIBLE * sum(finite.values()) / ratio))


def _measures(
    plans: dict, single: set, based: dict, context: dict, probe_bits: int, seed_of, shape_of, exact: bool
) -> dict:
    """What measures each slot of ``plans``: ``what -> slot -> (the probe of the first pass, that of the second or
    None: against the base, the squared distance D it adds per unit of sensitivity)``, ``what`` being ``("one",)`` for a
    slot probed at one width against the base, ``("width", bits, 2 or None)`` for a pair at a width (or a pass against
    the base where it is stored at that width), ``("choice", n)`` for the ``n``-th pair of its storage choices."""
    measures: dict[tuple, dict] = {}
    for slot, (widths, _) in plans.items():
        a, q = (shape_of(slot) if shape_of is not None else None) or (1.0, 0.0)

        def unit(x: float, a: float = a, q: float = q) -> float:  # D per unit of sensitivity at noise x: twice v/C
            return 2.0 * (a * x + q * x * x)

        if slot in single:  # g - base = J (e_probe - e_context): its variance is C (S(probe) + context)
            probe = Probe(slot, probe_bits, seed_of(slot, 1))
            d = unit(variance_factor(probe_bits)) / 2 + context[slot]  # against the exact base: the variance alone
            measures.setdefault(("one",), {})[slot] = (probe, None, d)
        elif slot in based and len(widths) == 1:  # in the form it is stored in: the base's draw is the other
            bits, choice, x = based[slot]
            probe = Probe(slot, bits, seed_of(slot, 1), choice)
            measures.setdefault(("one",), {})[slot] = (probe, None, unit(x))
        else:
            for k, bits in enumerate(widths):
                x = variance_factor(bits)
                first = Probe(slot, bits, seed_of(slot, 2 * k + 1))
                form = based.get(slot)
                against = partner(form, bits)
                if exact:  # against the exact base: the variance at the width
                    measures.setdefault(("width", bits, None), {})[slot] = (first, None, unit(x) / 2)
                elif form is not None and form[1] is None and form[0] == bits:  # the base's draw: the pair's other one
                    measures.setdefault(("width", bits, None), {})[slot] = (first, None, unit(x))
                elif against is not None:  # against the base's draw of the stored form: both variances
                    measures.setdefault(("width", bits, None), {})[slot] = (first, None, (unit(x) + unit(against)) / 2)
                else:
                    second = Probe(slot, bits, seed_of(slot, 2 * k + 2))
                    measures.setdefault(("width", bits, 2), {})[slot] = (first, second, unit(x))
    for slot, (widths, pairs) in plans.items():
        for n, pair in enumerate(pairs):
            seed = seed_of(slot, 2 * len(widths) + 1 + n)
            first, second = Probe(slot, pair[0].bits, seed, pair[0]), Probe(slot, pair[1].bits, seed, pair[1])
            if exact:  # the first against the exact base: its variance
                measures.setdefault(("choice", n), {})[slot] = (first, None, variance_factor(probe_bits))
            else:
                measures.setdefault(("choice", n), {})[slot] = (first, second, 4.0 * variance_factor(probe_bits))
    return measures


def cap(raw: dict) -> dict:
    """Replace non-finite sensitivities, and any above ``CAP_FACTOR`` times the median, by that ceiling."""
    positive = sorted(c for c in raw.values() if math.isfinite(c) and c > 0)
    ceiling = CAP_FACTOR * positive[len(positive) // 2] if positive else 1.0
    return {s: (min(c, ceiling) if math.isfinite(c) else ceiling) for s, c in raw.items()}
