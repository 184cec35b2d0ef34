"""An estimate's passes of the closure: counted and told to its progress, and each tensor measured alone, in groups
(``groups.py``: told apart by where their noise lands), with the negligible ones in one pass, or in a rotation (some of
those no group takes measured together in a later estimate, each scaled by what their pass measured).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch

from gactx.controller.adaptation.groups import (
    Profiles,
    Weights,
    measure_alone,
    parts,
    probe_in_groups,
    smallest,
    squares,
)
from gactx.controller.adaptation.ranks import distributed, mean_over_ranks

__all__ = ["CUTS", "GROUPED", "HALVES", "ROTATE", "ROTATIONS", "SPREAD", "Passes"]

# Probe tensors whose profiles are known in groups (estimate_sensitivities); False: each alone.
GROUPED = True
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
# is measured together, and where one half is borne out, the other's halves in turn, down to fewer than HALVES (then
# each alone): one tensor that moved apart from the others costs a few passes, not one for each of them (ResNet-50
# small: a later adaptation's 14 rotated tensors cost it 14 more passes); where both halves are refused and their
# ratios disagree (beyond SPREAD), two passes more than each alone; where they agree, each half at its own scale (a
# trained ResNet-50 small's refused later adaptation 19 passes, not 27). 0: each alone.
HALVES = 4
# A rotation's pass is borne out where what it measured over what its tensors were expected to put is within this factor
# of the median such ratio of the tensors measured on their own (Passes._rotated). A pass against the base of one
# BatchNorm input of ResNet-50 small varies by a coefficient of 0.17 to 0.48 between probe seeds, so some refusals are
# that noise. At 3, benchmarks.later's passes fell by at most 7% (none on ResNet-50 or BERT-base), and the LoRA
# decoder's error rose from 0.968x to 1.021x of measuring each alone (ViT-B/16's fell from 0.997x to 0.976x).
SPREAD = 2.0
# Normalisation inputs of one kind measured alone whose noise passes one cut (cuts.py: a ResNet bottleneck's BatchNorm
# inputs, below which lies the block's input) share the backward below it: each is measured down to the cut, and the
# one whose gradient there differs most below it too; the others' part below is that one's, scaled by how much their
# gradients at the cut differ (Passes._through). False: each its own backward below the cut.
CUTS = True


class Passes:
    """An estimate's passes of the closure (``gradient()``: one, from the estimate's snapshot, its gradients),
    each with the probes it is given, counted and its progress told; ``base`` the base pass's gradient once run.
    ``done``: the passes run; ``total``: those planned so far, revised as measurements decide (groups formed, a
    curve's second width left out, a shared pass not borne out), what ran once the estimate ends."""

    def __init__(
        self,
        gradient: Callable[[], list[torch.Tensor]],
        set_probe: Callable[[object], None],
        sizes: tuple[int, ...],
        progress: Callable[[int, int], None] | None,
        weights: Weights | None = None,
    ) -> None:
        self.set_probe, self.sizes, self.progress = set_probe, sizes, progress
        # each parameter's weight in the squared distances, from the estimate's first gradient (groups.Weights)
        self.weights = Weights(relative=False) if weights is None else weights
        self._gradient = lambda: self.weights.observe(gradient())
        self.done, self.total = 1, 1  # the discovering pass
        self.base: list[torch.Tensor] | None = None
        # probes -> the gradients' difference from the base, from the nodes the probes perturb, or None where it
        # cannot (replayed.Replayed.difference); None: every pass against the base is a whole one
        self.difference: Callable[[dict], list | None] | None = None
        # told the slots the next passes probe, in order, where difference reads what it needs by windows
        self.expect: Callable[[list], None] | None = None
        # the cut below a slot's nodes (replayed.Replayed.cut_of), a pass split there (split) and one below it (below)
        self.cut_of: Callable | None = None
        self.split: Callable | None = None
        self.below: Callable | None = None
        self.curved: frozenset = frozenset()  # the normalisation inputs, whose measurements alone may share a cut
        self.partial = 0  # the passes difference ran from the probed nodes down
        self.rotated: dict = {}  # the slots measured together by _rotated -> how many estimates in a row
        # of those, the ones scaled by halves that bore out only each other (_halves): on their own in the next estimate
        self.unsettled: set = set()
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
        return mean_over_ranks(parts(a, self.gradient(second), self.weights.vector))

    def distance(self, probes: dict) -> torch.Tensor:
        """The squared distance in each parameter's gradient of a pass with ``probes`` from the base, this process's
        (not counted): from the nodes the probes perturb where it can (:attr:`difference`), else a whole pass."""
        if self.difference is not None:
            difference = self.difference(probes)
            if difference is not None:
                self.partial += 1
                return squares(difference, self.weights.vector)
        self.set_probe(probes)
        return parts(self._gradient(), self.base, self.weights.vector)

    def measure(
        self, row: dict, kept: Profiles, raw: dict, shares: dict, part: str, negligible: float = 0.0,
        later: Sequence = (),
    ) -> tuple[dict, dict]:  # fmt: skip
        """Measure each slot of ``row`` (slot -> first probe, second or ``None``, D per unit of sensitivity): in groups
        where its profile is known (measured in this estimate, ``shares``, or ``kept``) and its sensitivity (``raw``
        or ``kept``), else alone; the passes counted to ``part``. Slots measured against the base that are expected
        to put the least in the gradient, at most ``negligible`` together (``sensitivity.NEGLIGIBLE``), are measured
        in one pass, each scaled by what it measured over what they were expected to put (:meth:`_together`); there,
        of the slots no group takes, up to half are measured together likewise, last, where each was measured on its
        own at the probe width in the last estimate (:meth:`_rotation`). ``later``: the slots the estimate measures
        after these, in order (a window of given gradients holds their nodes too). Returns ``(slot -> D, slot ->
        profile measured alone)``."""
        if self.expect is not None:
            self.expect([*row, *later])
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
                self.expect([*grouped, *alone, *joint, *later])

        grouped, fresh = probe_in_groups({s: (row[s][0], row[s][1], e) for s, e in expected.items()}, self.run, formed)
        found.update(grouped)
        self.total += self.done - before - planned  # members the groups' passes did not explain, measured alone
        alone = [s for s in row if s not in found and s not in joint]
        for group in self._by_cut(row, alone):
            if len(group) > 1:
                self._through(row, group, found, fresh)
            else:
                measure_alone(group[0], row[group[0]][0], row[group[0]][1], self.run, found, fresh)
        if joint:
            # The tensors measured on their own (not with the negligible ones: those left ``expected``)
            ratios = [found[s] / float(e.sum()) for s, e in expected.items() if s in found and e.sum() > 0]
            rotated = self._rotated(row, joint, expected, statistics.median(ratios) if ratios else 1.0)
            found.update(rotated)
            # each measured on its own in the next estimate where no more may be so in a row, or _halves says so
            self.rotated.update((s, ROTATIONS if s in self.unsettled else kept.rotated.get(s, 0) + 1) for s in rotated)
            for slot in joint:  # their pass not borne out: each alone
                if slot not in found:
                    measure_alone(slot, row[slot][0], row[slot][1], self.run, found, fresh)
        self.spent(part, len(row), self.done - start)
        return found, fresh

    def _by_cut(self, row: dict, alone: list) -> list[list]:
        """``alone`` (slots of ``row`` each to be measured on its own), in order, as groups: the normalisation inputs
        measured against the base whose nodes' cut is one, of one kind of node, together where :data:`CUTS` (at the
        first of them), each other slot on its own."""
        if not CUTS or self.cut_of is None:
            return [[s] for s in alone]
        groups: dict = {}  # ("cut", node, input, kind) or ("alone", slot) -> its slots, in order of the first
        for slot in alone:
            cut = self.cut_of(slot) if slot in self.curved and row[slot][1] is None else None
            key = ("alone", slot) if cut is None else ("cut", cut.edge.node, cut.edge.output_nr, cut.kind)
            groups.setdefault(key, []).append(slot)
        return list(groups.values())

    def _through(self, row: dict, group: list, found: dict, fresh: dict) -> None:
        """Measure the slots of ``group`` (one cut below their nodes, :meth:`_by_cut`), each against the base: its pass
        down to the cut (``split``: what it puts above, exact, and the difference of the gradient the cut is given),
        then for the one whose difference there is largest, that difference's backward below the cut (``below``); the
        others' parts below are that one's, each times its squared difference at the cut over that one's (:data:`CUTS`).
        ``D`` into ``found`` and profiles into ``fresh``, as :func:`groups.measure_alone` gives them; a slot whose pass
        cannot be split so is measured alone."""
        split = {}
        for slot in group:
            got = self.split(slot, row[slot][0])
            if got is None:
                measure_alone(slot, row[slot][0], row[slot][1], self.run, found, fresh)
                continue
            self._tick()
            self.partial += 1
            above, delta = got
            energy = 0.0 if delta is None else float(delta.double().square().sum())  # a host read, as a pass's
            split[slot] = (squares(above, self.weights.vector), delta, energy)
        if not split:
            return
        widest = max(split, key=lambda s: split[s][2])
        _, delta, most = split[widest]
        far = self.below(widest, delta) if most > 0 else [None] * len(self.sizes)
        if far is None:  # its backward below the cut raised: each measured alone (whole passes from here on)
            self.total += len(split)  # passes again, besides the split ones counted
            for slot in split:
                measure_alone(slot, row[slot][0], row[slot][1], self.run, found, fresh)
            return
        below = squares(far, self.weights.vector)
        for slot, (above, _, energy) in split.items():
            d = above + (below if slot == widest else below * (energy / most if most > 0 else 0.0))
            found[slot] = whole = float(d.sum())
            if whole > 0 and math.isfinite(whole):
                fresh[slot] = d / whole

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
        ))[0]  # fmt: skip

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
        expected to put, less than ``1 / SPREAD`` or more than :data:`SPREAD` times the ``reference`` ratio (the median
        of the tensors the estimate measured on their own: they moved apart from the others since, and may have moved
        apart from each other; the pass is counted as spent), but for the halves that then bear it out
        (:meth:`_halves`)."""

        def accept(measured: float, want: float) -> bool:
            return reference > 0 and reference / SPREAD <= measured / want <= SPREAD * reference

        found, _ = self._scaled(row, {s: float(expected[s].sum()) for s in joint}, accept)
        return found or self._halves(row, joint, expected, accept)

    def _halves(self, row: dict, refused: list, expected: dict, accept: Callable[[float, float], bool]) -> dict:
        """Where ``refused`` (tensors whose pass together ``accept`` refused) are :data:`HALVES` or more: each half of
        them measured together in one pass (:meth:`_scaled`), and where one half is borne out and the other is not,
        the other's halves so in turn, and so on down. Where both are refused but bear each other out (their ratios of
        measured to expected within :data:`SPREAD` of each other: the tensors moved together, apart from those
        measured on their own), each half is scaled by its own pass, and its tensors are measured on their own in the
        next estimate (:attr:`unsettled`). Else the tensors that moved are in both: each is measured alone, at two
        passes more than measuring them so at once. ``slot -> D`` of those borne out."""
        if HALVES < 2 or len(refused) < HALVES:
            return {}
        self.total += 2 - len(refused)  # two passes for them, not one each (as _scaled counted them)
        half = len(refused) // 2
        parts = refused[:half], refused[half:]
        (first, a), (second, b) = (self._scaled(row, {s: float(expected[s].sum()) for s in p}, accept) for p in parts)
        if first and not second:
            return {**first, **self._halves(row, parts[1], expected, accept)}
        if second and not first:
            return {**second, **self._halves(row, parts[0], expected, accept)}
        agree = all(math.isfinite(r) and r > 0 for r in (a, b)) and max(a, b) <= SPREAD * min(a, b)
        if not first and not second and agree:
            self.total -= len(refused)  # not measured alone after all (_scaled counted each so)
            self.unsettled.update(refused)
            return {s: float(expected[s].sum()) * r for p, r in zip(parts, (a, b), strict=True) for s in p}
        return {**first, **second}

    def _scaled(self, row: dict, want: dict, accept: Callable[[float, float], bool]) -> tuple[dict, float]:
        """``(slot -> D, ratio)`` of the slots of ``want`` (slot -> what each is expected to put in the gradient) from
        one pass against the base with all of them probed: each its expectation times the pass's ``ratio``, its
        distance over their expectations' sum. ``{}`` where ``accept(measured, expected)`` (their sums) refuses what
        the pass measured: then each is measured as the others are, and the pass is counted as spent."""
        measured = float(self.run({s: row[s][0] for s in want}, None).sum())
        total = sum(want.values())
        ratio = measured / total if total > 0 and math.isfinite(measured) else math.nan
        if not (total > 0 and math.isfinite(measured) and accept(measured, total)):
            self.total += len(want)
            return {}, ratio
        return {s: w * measured / total for s, w in want.items()}, ratio

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
