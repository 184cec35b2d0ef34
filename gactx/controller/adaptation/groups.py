"""Several tensors probed in the same passes, told apart by where in the gradient their noise lands.

A tensor probed alone (``sensitivity.py``: a pass against the base, or a pair) leaves a squared distance between two
gradients spread over the parameters' gradients in a pattern of its own: its *profile*, the share of that squared
distance in each parameter's gradient. The input of a block's last normalisation reaches that block's weights and
everything before it; the probabilities of a head's attention reach its projections first. An estimate keeps each
tensor's profile, and a later one (or a later measurement of the same estimate: a storage choice's pairs after the
tensor's own pass) probes tensors whose profiles overlap little in the same passes, each with the seeds it would have
alone: their noises are independent, so their variances add in every parameter's gradient, ``D_j = sum_i s_i u_ij``,
where ``u_ij`` is what tensor ``i`` is expected to put in parameter ``j`` (its profile times its last sensitivity, at
the noise it is probed at now) and ``s_i`` how far that is off. The scales are the maximum-likelihood solution of
those equations as a mixture of independent squared distances (:func:`_scales`).

Tensors go together only where each keeps most of what it puts in the gradient to itself (:data:`PURITY`): a
tensor's purity in a group is ``sum_j u_ij^2 / sum_k u_kj`` over ``sum_j u_ij``, 1 where no other member reaches its
parameters. Where the passes do not bear the solution out (:func:`_fit`), the members they name are measured alone, and
their profiles afresh (:func:`probe_in_groups`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from gactx.controller.adaptation.ranks import distributed, mean_over_ranks

__all__ = [
    "GROUPED", "HALVES", "PURITY", "ROTATE", "ROTATIONS", "UNEXPLAINED", "Passes", "Profiles", "form_groups",
    "layout_of", "parts", "probe_in_groups", "smallest", "solve", "squares",
]  # fmt: skip

# Probe tensors whose profiles are known in groups (estimate_sensitivities); False: each alone.
GROUPED = True
# The least purity every member of a group keeps (module docstring). Chosen on a later adaptation of the
# character-level transformer, BERT-base, ResNet-50 and the LoRA decoder (small) with the passes against the base: 0.6
# put 18, 18, 53 and 38 tensors into 7, 8, 36 and 13 passes, the sensitivities as far from an independent estimate as
# two estimates alone are; at 0.4 some members' estimates fell to nothing.
PURITY = 0.6
# The largest share of a group pass's squared distance that may land where no member's profile put any.
UNEXPLAINED = 0.1
# In a later estimate, some of the tensors that no group takes are measured together in one pass, each scaled by what
# it measured over what they were expected to put (Passes._rotation, Passes._rotated). False: each alone.
ROTATE = True
# The most estimates in a row a tensor is measured so: each is measured on its own at least every ROTATIONS + 1
# estimates, and up to ROTATIONS / (ROTATIONS + 1) of those no group takes are measured together. 2 against 1: ResNet-50
# small's later adaptations in the adaptation benchmark 15 passes against 17; after 5 x 10 SGD steps, each followed by
# a later adaptation, the gradient errors at the allocations 0.97x to 1.00x of measuring each alone every time on
# ResNet-50, BERT-base, ViT-B/16 (small) and the LoRA decoder, the zoo BERT, GAT, ResNet and transformer layer (1.00x
# to 1.02x at 1).
ROTATIONS = 2
# Where the pass of the tensors measured together in a rotation is not borne out (Passes._rotated), each half of them
# is measured together in turn, and so on down to fewer than HALVES (then each alone): one tensor that moved apart from
# the others costs a few passes, not one for each of them (ResNet-50 small: a later adaptation's 14 rotated tensors
# cost it 14 more passes). 0: each alone.
HALVES = 4
# A rotation's pass is borne out where what it measured over what its tensors were expected to put is within this factor
# of the median such ratio of the tensors measured on their own (Passes._rotated). A pass against the base of one
# BatchNorm input of ResNet-50 small varies by a coefficient of 0.17 to 0.48 between probe seeds, so some refusals are
# that noise. At 3, benchmarks.later's passes fell by at most 7% (none on ResNet-50 or BERT-base), and the LoRA
# decoder's error rose from 0.968x to 1.021x of measuring each alone (ViT-B/16's fell from 0.997x to 0.976x).
SPREAD = 2.0


@dataclass(frozen=True)
class Profiles:
    """Each probed tensor's profile (its share of ``||g - g_base||^2`` in each parameter's gradient, summing to 1) and
    its sensitivity when the profile was last measured or scaled, on one ``layout`` of the gradients."""

    layout: tuple[int, ...] = ()  # ids of the parameters whose gradients a pass gives, in order
    shares: Mapping[Hashable, torch.Tensor] = field(default_factory=dict)
    sensitivity: Mapping[Hashable, float] = field(default_factory=dict)
    # The tensors the estimate that made these measured so (Passes._rotated), each with how many estimates in a row
    rotated: Mapping[Hashable, int] = field(default_factory=dict)
    # Those it measured at the probe width against the base (not a curve's widths): what a rotation may scale
    probed: frozenset = frozenset()


def layout_of(model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids and sizes of the parameters that hold a gradient, in ``model.parameters()`` order: the layout of a
    pass's gradients (``sensitivity._gradient``)."""
    params = [p for p in model.parameters() if p.grad is not None]
    return tuple(id(p) for p in params), tuple(p.numel() for p in params)


def parts(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """The squared distance between two passes' gradients (``sensitivity._gradient``) in each parameter, on the host
    (float64): the difference and the sum of its squares in the gradients' precision (half precision's in float32;
    torch's cascaded sum: 2e-8 relative on a 768 x 2304 float32 gradient, a third of the time of a sum in float64)."""
    if not a:  # no parameter has a gradient: nothing to measure
        return torch.zeros(0, dtype=torch.float64)
    return _on_host([_squared_distance(x, y) for x, y in zip(a, b, strict=True)])


def squares(difference: list[torch.Tensor | None]) -> torch.Tensor:
    """:func:`parts` of a pass whose gradients' difference from the base is given (``replayed.Replayed.difference``;
    ``None``: no difference there): each one's norm in float32 (half precision's too) by one multi-tensor kernel a
    device and dtype (a sum of squares a parameter was three kernels each, a host-bound GPU's time), squared in
    float64."""
    present = [i for i, d in enumerate(difference) if d is not None]
    out = torch.zeros(len(difference), dtype=torch.float64)
    if present:
        norms = torch._foreach_norm([difference[i] for i in present], 2, dtype=torch.float32)
        out[present] = _on_host(norms).double().square()
    return out


def _on_host(sums: list[torch.Tensor]) -> torch.Tensor:
    """Scalars on the gradients' devices (several where the model is split across them) as one host vector: one
    copy for each scalar on another device than the first one."""
    first = sums[0].device
    return torch.stack([s if s.device == first else s.to(first) for s in sums]).cpu()


def _squared_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        x, y = x.float(), y.float()
    return x.sub(y).pow_(2).sum().double()  # squared in place: a third less time than (x - y).square()


def form_groups(expected: Mapping[Hashable, torch.Tensor], purity: float | None = None) -> list[list[Hashable]]:
    """Greedy groups of the slots of ``expected`` (slot -> what its probe is expected to put in each parameter's
    gradient): largest first, each into the first group where every member's purity stays at least ``purity``
    (:data:`PURITY` where ``None``)."""
    purity = PURITY if purity is None else purity
    order = sorted(expected, key=lambda s: -float(expected[s].sum()))
    groups: list[tuple[list[Hashable], torch.Tensor]] = []  # members, and their expected values stacked
    for slot in order:
        row = expected[slot].unsqueeze(0)
        for n, (members, stacked) in enumerate(groups):
            trial = torch.cat([stacked, row])
            if float(_purity(trial).min()) >= purity:
                groups[n] = ([*members, slot], trial)
                break
        else:
            groups.append(([slot], row))
    return [members for members, _ in groups]


def _purity(stacked: torch.Tensor) -> torch.Tensor:
    """Each row's purity among the rows of ``stacked`` (members x parameters; the module docstring)."""
    column = stacked.sum(0).clamp_min(1e-300)
    return (stacked * stacked / column).sum(1) / stacked.sum(1).clamp_min(1e-300)


def _fit(expected: list[torch.Tensor], measured: torch.Tensor, purity: float) -> tuple[list[float] | None, list[int]]:
    """``(scales, [])`` where the members' scaled contributions explain ``measured`` (:func:`solve`), else ``(None,
    the members to take out)``: those whose scale is not positive or whose purity is below ``purity``, or all of them
    where the solution is not finite or the distance lands where no member is expected."""
    everyone = list(range(len(expected)))
    a = torch.stack(expected, dim=1)  # parameters x members
    total = a.sum(1)
    reached = total > 1e-12 * float(total.max())  # a parameter a member's noise reaches, not a rounding's worth
    whole = float(measured.sum())
    if not whole > 0 or float(measured[~reached].sum()) > UNEXPLAINED * whole:
        return None, everyone
    scales = _scales(a[reached], measured[reached])
    if not bool(torch.isfinite(scales).all()):
        return None, everyone
    kept = _purity((a * scales.clamp_min(0)).T)
    out = [i for i in everyone if float(scales[i]) <= 0 or float(kept[i]) < purity]
    return (None, out) if out else (scales.tolist(), [])


def _scales(a: torch.Tensor, measured: torch.Tensor, iterations: int = 2000) -> torch.Tensor:
    """The scales ``s`` for which ``a @ s`` (parameters x members) best explains ``measured`` as a sum of independent
    squared distances, by the multiplicative (expectation-maximisation) update of a mixture: each parameter's measured
    distance is shared among the members in proportion to what each is expected to put there, and each member's scale
    is what it was given over what it was expected to put in all. A parameter weighs by what it holds: one where the
    members were expected to put almost nothing, whose share moved most with the other tensors' widths (the queries'
    weights of a BERT layer reached 400 times what a GELU input's profile said), cannot drive a scale. Exact where the
    measured distances are a scaled sum."""
    s = torch.ones(a.shape[1], dtype=a.dtype)
    mass = a.sum(0).clamp_min(1e-300)
    for _ in range(iterations):
        model = a @ s
        new = s * (a.T @ (measured / model.clamp_min(1e-300))) / mass
        if bool(((new - s).abs() <= 1e-12 * new.abs()).all()):
            return new
        s = new
    return s


def solve(expected: list[torch.Tensor], measured: torch.Tensor, purity: float | None = None) -> list[float] | None:
    """The scale of each member's expected contribution that together explain ``measured`` (a group pass's squared
    distance in each parameter's gradient, :func:`_scales`); ``None`` where a
    scale is not positive and finite, more than :data:`UNEXPLAINED` of the distance lands where none is expected, or
    a member's purity among the contributions found is below ``purity`` (a sensitivity that moved since the profiles
    were kept: the group was formed on magnitudes that no longer hold)."""
    return _fit(expected, measured, PURITY if purity is None else purity)[0]


def smallest(values: Mapping[Hashable, float], budget: float) -> list[Hashable]:
    """The keys of the smallest ``values``, smallest first, while their sum is at most ``budget``: the negligible
    tensors of ``sensitivity.NEGLIGIBLE``."""
    out, spent = [], 0.0
    for key in sorted(values, key=values.__getitem__):
        spent += values[key]
        if spent > budget:
            break
        out.append(key)
    return out


def probe_in_groups(
    members: Mapping[Hashable, tuple[object, object, torch.Tensor]],
    run: Callable[[dict, dict | None], torch.Tensor],
    formed: Callable[[list[list[Hashable]]], None] | None = None,
) -> tuple[dict, dict]:
    """Measure in groups the ``members`` (slot -> ``(first, second, expected)``: the probe of its first pass, that of
    its second or ``None`` where its first is read against the base, and what it is expected to put in each parameter's
    gradient); ``run(first, second)`` runs those passes with the probes by slot and returns their :func:`parts`. A
    group the passes do not explain (:func:`_fit`) has the members it names measured alone, each drawn as in the
    group's passes, so that what each put there is taken out of them, and the rest solved again. Returns ``(slot ->
    its squared distance D, slot -> its profile measured alone)`` for the members measured so; a slot in no group is
    left out of both. ``formed(groups)`` is told the groups before their passes run."""
    found, shares = {}, {}
    groups = [g for g in form_groups({s: m[2] for s, m in members.items()}) if len(g) >= 2]
    if formed is not None:
        formed(groups)
    for group in groups:
        against = members[group[0]][1] is None
        measured = run({s: members[s][0] for s in group}, None if against else {s: members[s][1] for s in group})
        while group:
            scales, out = _fit([members[s][2] for s in group], measured, PURITY)
            if scales is not None:
                found.update((s, k * float(members[s][2].sum())) for s, k in zip(group, scales, strict=True))
                break
            for slot in [group[i] for i in out]:
                alone = measure_alone(slot, members[slot][0], members[slot][1], run, found, shares)
                measured = (measured - alone).clamp_min(0.0)
                group.remove(slot)
    return found, shares


def measure_alone(slot, first, second, run, found: dict, shares: dict) -> torch.Tensor:
    """Measure ``slot`` alone (``run``: :func:`probe_in_groups`'): its squared distance into ``found``, where it landed
    into ``shares`` (its profile); returns its :func:`parts`."""
    alone = run({slot: first}, None if second is None else {slot: second})
    found[slot] = whole = float(alone.sum())
    if whole > 0 and math.isfinite(whole):
        shares[slot] = alone / whole
    return alone


class Passes:
    """An estimate's passes of the closure (``gradient()``: one, from the estimate's snapshot, its gradients),
    each with the probes it is given, counted and its progress told; ``base`` the base pass's gradient once run."""

    def __init__(
        self,
        gradient: Callable[[], list[torch.Tensor]],
        set_probe: Callable[[object], None],
        sizes: tuple[int, ...],
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self._gradient, self.set_probe, self.sizes, self.progress = gradient, set_probe, sizes, progress
        self.done, self.total = 1, 1  # the discovering pass
        self.base: list[torch.Tensor] | None = None
        # probes -> the gradients' difference from the base, from the nodes the probes perturb, or None where it
        # cannot (replayed.Replayed.difference); None: every pass against the base is a whole one
        self.difference: Callable[[dict], list | None] | None = None
        # told the slots the next passes probe, in order, where difference reads what it needs by windows
        self.expect: Callable[[list], None] | None = None
        self.later: list = []  # the slots the estimate measures after those of the measurement under way, in order
        self.partial = 0  # the passes difference ran from the probed nodes down
        self.rotated: dict = {}  # the slots measured together by _rotated -> how many estimates in a row
        self.parts: dict[str, tuple[int, int]] = {"discovery": (0, 1)}  # part -> (measurements, passes)

    def spent(self, part: str, measurements: int, passes: int) -> None:
        """Count ``passes`` of the estimate, and the tensors' ``measurements`` they made, to ``part``."""
        had = self.parts.get(part, (0, 0))
        self.parts[part] = (had[0] + measurements, had[1] + passes)

    def no_first(self) -> None:
        """The estimate ran no first pass (the discovering pass counted from the start): not counted."""
        self.done, self.total = self.done - 1, self.total - 1
        self.parts.pop("discovery", None)

    def gradient(self, probes) -> list[torch.Tensor]:
        self._tick()
        self.set_probe(probes)
        return self._gradient()

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)
        self.done += 1

    def run(self, first: dict, second: dict | None) -> torch.Tensor:
        """The squared distance in each parameter's gradient (``groups.parts``) between a pass with the ``first``
        probes and one with the ``second``, or the base where ``second`` is ``None``."""
        if second is None:
            self._tick()
            return mean_over_ranks(self.distance(first))
        a = self.gradient(first)
        return mean_over_ranks(parts(a, self.gradient(second)))

    def distance(self, probes: dict) -> torch.Tensor:
        """The squared distance in each parameter's gradient of a pass with ``probes`` from the base, this process's
        (not counted): from the nodes the probes perturb where it can (:attr:`difference`), else a whole pass."""
        if self.difference is not None:
            difference = self.difference(probes)
            if difference is not None:
                self.partial += 1
                return squares(difference)
        self.set_probe(probes)
        return parts(self._gradient(), self.base)

    def measure(
        self, row: dict, kept: Profiles, raw: dict, shares: dict, part: str, negligible: float = 0.0
    ) -> tuple[dict, dict]:
        """Measure each slot of ``row`` (slot -> first probe, second or ``None``, D per unit of sensitivity): in groups
        where its profile is known (measured in this estimate, ``shares``, or ``kept``) and its sensitivity (``raw``
        or ``kept``), else alone; the passes counted to ``part``. Slots measured against the base that are expected
        to put the least in the gradient, at most ``negligible`` together (``sensitivity.NEGLIGIBLE``), are measured
        in one pass, each scaled by what it measured over what they were expected to put (:meth:`_together`); there,
        of the slots no group takes, up to half are measured together likewise, last, where each was measured on its
        own at the probe width in the last estimate (:meth:`_rotation`). Returns ``(slot -> D, slot -> profile
        measured alone)``."""
        if self.expect is not None:
            self.expect([*row, *self.later])
        expected = {}
        if GROUPED:
            for slot, (_, _, unit) in row.items():
                share = shares.get(slot, kept.shares.get(slot))
                c = raw.get(slot, kept.sensitivity.get(slot))
                if share is not None and c is not None and math.isfinite(c) and c > 0 and unit > 0:
                    expected[slot] = c * unit * share
            expected = self._agreed(list(row), expected)
        start = self.done
        found = self._together(row, expected, negligible)
        expected = {s: e for s, e in expected.items() if s not in found}
        before, planned, joint = self.done, 0, []

        def formed(groups: list) -> None:  # each group's passes for its members' own: the progress's total exact
            nonlocal planned, joint
            planned = sum(1 if row[g[0]][1] is None else 2 for g in groups)
            self.total += planned - sum(1 if row[s][1] is None else 2 for g in groups for s in g)
            grouped = [s for g in groups for s in g]
            taken = set(grouped)
            if negligible > 0 and ROTATE:  # a later estimate (an allocation in force)
                single = {s: float(e.sum()) for s, e in expected.items() if s not in taken}
                joint = self._rotation(row, single, kept)
            if self.expect is not None:  # the groups first, then the slots measured alone, then those rotated
                alone = [s for s in row if s not in taken and s not in found and s not in joint]
                self.expect(grouped + alone + joint + self.later)

        grouped, fresh = probe_in_groups({s: (row[s][0], row[s][1], e) for s, e in expected.items()}, self.run, formed)
        found.update(grouped)
        self.total += self.done - before - planned  # members the groups' passes did not explain, measured alone
        for slot, (first, second, _) in row.items():
            if slot not in found and slot not in joint:
                measure_alone(slot, first, second, self.run, found, fresh)
        if joint:
            # The tensors measured on their own (not with the negligible ones: those left ``expected``)
            ratios = [found[s] / float(e.sum()) for s, e in expected.items() if s in found and e.sum() > 0]
            rotated = self._rotated(row, joint, expected, statistics.median(ratios) if ratios else 1.0)
            found.update(rotated)
            self.rotated.update((s, kept.rotated.get(s, 0) + 1) for s in rotated)
            for slot in joint:  # their pass not borne out: each alone
                if slot not in found:
                    measure_alone(slot, row[slot][0], row[slot][1], self.run, found, fresh)
        self.spent(part, len(row), self.done - start)
        return found, fresh

    def _together(self, row: dict, expected: dict, negligible: float) -> dict:
        """``slot -> D`` of the slots of ``row`` measured against the base whose expected contributions are the
        smallest, at most ``negligible`` together, from one pass with all of them probed: each its expectation times
        the pass's distance over their expectations' sum. ``{}`` where fewer than two are so, or where the pass
        measured more than twice ``negligible`` (they grew since their sensitivities were measured: then each is
        measured as the others are, and the pass is counted as spent)."""
        if negligible <= 0:
            return {}
        small = smallest({s: float(e.sum()) for s, e in expected.items() if row[s][1] is None}, negligible)
        if len(small) < 2:
            return {}
        self.total += 1 - len(small)  # their passes, as the progress tells them before this one runs
        return self._scaled(row, {s: float(expected[s].sum()) for s in small}, lambda measured, _: (
            measured <= 2 * negligible
        ))  # fmt: skip

    def _rotation(self, row: dict, single: dict, kept: Profiles) -> list:
        """The tensors of ``row`` that no group took (``single``: slot -> what each is expected to put in the gradient)
        to measure together in one pass (:data:`ROTATE`, :meth:`_rotated`): of those measured against the base that
        the last estimate (``kept``) measured at the probe width (not at a curve's widths, whose line the expectation
        at the probe width is read on) and had not measured so :data:`ROTATIONS` estimates in a row, those measured so
        the fewest times in a row first, the smallest among them first, at most ``ROTATIONS / (ROTATIONS + 1)`` of
        ``single``; ``[]`` where fewer than two are so. The estimate measures the others alone: each tensor is
        measured on its own at least every ``ROTATIONS + 1`` estimates, and the cost levels at ``1 / (ROTATIONS + 1)``
        of them alone."""
        if len(single) < 3:
            return []
        counts = kept.rotated
        candidates = [s for s in single if s in kept.probed and counts.get(s, 0) < ROTATIONS and row[s][1] is None]
        joint = sorted(candidates, key=lambda s: (counts.get(s, 0), single[s]))
        joint = joint[: len(single) * ROTATIONS // (ROTATIONS + 1)]
        if len(joint) < 2:
            return []
        self.total += 1 - len(joint)
        return joint

    def _rotated(self, row: dict, joint: list, expected: dict, reference: float) -> dict:
        """``slot -> D`` of the ``joint`` slots of ``row`` from one pass with all of them probed: each its expectation
        times the pass's distance over their expectations' sum. ``{}`` where the pass measured, over what they were
        expected to put, less than half or more than twice the ``reference`` ratio (the median of the tensors the
        estimate measured on their own: they moved apart from the others since, and may have moved apart from each
        other; the pass is counted as spent), or for the members of no half that was borne out (:data:`HALVES`)."""
        return self._halved(row, joint, expected, lambda measured, want: (
            reference > 0 and reference / SPREAD <= measured / want <= SPREAD * reference
        ))  # fmt: skip

    def _halved(self, row: dict, members: list, expected: dict, accept: Callable[[float, float], bool]) -> dict:
        """``slot -> D`` of ``members`` from one pass with all of them probed (:meth:`_scaled`); where ``accept``
        refuses it and they are :data:`HALVES` or more, each half of them (in their order) measured so in turn, and so
        on down. Those of no pass borne out are left out, to be measured alone."""
        found = self._scaled(row, {s: float(expected[s].sum()) for s in members}, accept)
        if found or HALVES < 2 or len(members) < HALVES:
            return found
        self.total += 2 - len(members)  # two passes for them, not one each (as _scaled counted them)
        half = len(members) // 2
        first = self._halved(row, members[:half], expected, accept)
        return {**first, **self._halved(row, members[half:], expected, accept)}

    def _scaled(self, row: dict, want: dict, accept: Callable[[float, float], bool]) -> dict:
        """``slot -> D`` of the slots of ``want`` (slot -> what each is expected to put in the gradient) from one pass
        against the base with all of them probed: each its expectation times the pass's distance over their
        expectations' sum. ``{}`` where ``accept(measured, expected)`` (their sums) refuses what the pass measured:
        then each is measured as the others are, and the pass is counted as spent."""
        measured = float(self.run({s: row[s][0] for s in want}, None).sum())
        total = sum(want.values())
        if not (total > 0 and math.isfinite(measured) and accept(measured, total)):
            self.total += len(want)
            return {}
        return {s: w * measured / total for s, w in want.items()}

    def _agreed(self, slots: list, expected: dict) -> dict:
        """``expected`` averaged over the ranks (``ranks.mean_over_ranks``), for the slots every rank expects something
        of; ``expected`` itself where one process runs."""
        if not distributed():
            return expected
        table = torch.zeros(len(slots), len(self.sizes) + 1, dtype=torch.float64)
        for i, slot in enumerate(slots):
            if slot in expected:
                table[i, :-1], table[i, -1] = expected[slot], 1.0
        table = mean_over_ranks(table)
        return {slot: table[i, :-1] for i, slot in enumerate(slots) if table[i, -1] == 1.0}
