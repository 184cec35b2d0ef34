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
their profiles afresh (:func:`probe_in_groups`). An estimate's passes use these (``passes.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "FLOOR", "PURITY", "UNEXPLAINED", "Profiles", "Weights", "form_groups", "layout_of", "parts",
    "probe_in_groups", "measure_alone", "smallest", "solve", "squares", "weights",
]  # fmt: skip

# The least purity every member of a group keeps (module docstring). Chosen on a later adaptation of the
# character-level transformer, BERT-base, ResNet-50 and the LoRA decoder (small) with the passes against the base: 0.6
# put 18, 18, 53 and 38 tensors into 7, 8, 36 and 13 passes, the sensitivities as far from an independent estimate as
# two estimates alone are; at 0.4 some members' estimates fell to nothing.
PURITY = 0.6
# The largest share of a group pass's squared distance that may land where no member's profile put any.
UNEXPLAINED = 0.1
# An estimate for Config.objective "update" weighs each parameter's part of a squared distance by the whole
# gradient's mean square over its own (weights()): the error Adam's update sees, which divides each gradient by its own
# scale, so that noise in a parameter whose gradient is small counts for what it does to that parameter's step.
# A parameter's mean square is taken as at least this share of the whole gradient's: a bias that a normalisation
# follows has a gradient of rounding errors alone (1e-12 of the mean), which would take every weight.
FLOOR = 1e-4


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


def weights(gradient: list[torch.Tensor]) -> torch.Tensor:
    """Each parameter's weight in a squared distance (``Config.objective`` ``"update"``), from a pass's ``gradient``:
    the gradient's mean square over the parameter's own, that at least :data:`FLOOR` of the whole's (float64, on the
    host). A distance weighed so is in the gradient's units: where every parameter's mean square is the same, each
    weight is 1."""
    if not gradient:
        return torch.zeros(0, dtype=torch.float64)
    norms = torch._foreach_norm([g if g.dtype in (torch.float32, torch.float64) else g.float() for g in gradient], 2)
    sums = _on_host([n.double() for n in norms]).square()
    sizes = torch.tensor([g.numel() for g in gradient], dtype=torch.float64)
    whole = float(sums.sum()) / float(sizes.sum())
    if not whole > 0 or not math.isfinite(whole):  # no gradient at all (or not a finite one): no weighing
        return torch.ones(len(gradient), dtype=torch.float64)
    return whole / (sums / sizes).clamp_min(FLOOR * whole)


class Weights:
    """The weights of one estimate's squared distances (:func:`weights`) where ``relative``: ``vector`` where given
    (an earlier estimate's), else taken from the first gradient it is shown (:meth:`observe`); ``None`` until then, and
    where not ``relative`` (the squared distances as they are)."""

    def __init__(self, relative: bool = True, vector: torch.Tensor | None = None) -> None:
        self.relative = relative
        self.vector = vector if relative else None

    def observe(self, gradient: list[torch.Tensor]) -> list[torch.Tensor]:
        """``gradient``, a pass's, as it is; the first one sets the weights."""
        if self.vector is None and self.relative:
            self.vector = weights(gradient)
        return gradient


def parts(a: list[torch.Tensor], b: list[torch.Tensor], weighed: torch.Tensor | None = None) -> torch.Tensor:
    """The squared distance between two passes' gradients (``sensitivity._gradient``) in each parameter, on the host
    (float64), times ``weighed`` where given (:func:`weights`): the difference and the sum of its squares in the
    gradients' precision (half precision's in float32; torch's cascaded sum: 2e-8 relative on a 768 x 2304 float32
    gradient, a third of the time of a sum in float64)."""
    if not a:  # no parameter has a gradient: nothing to measure
        return torch.zeros(0, dtype=torch.float64)
    out = _on_host([_squared_distance(x, y) for x, y in zip(a, b, strict=True)])
    return out if weighed is None else out * weighed


def squares(difference: list[torch.Tensor | None], weighed: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`parts` of a pass whose gradients' difference from the base is given (``replayed.Replayed.difference``;
    ``None``: no difference there): each one's norm in float32 (half precision's too) by one multi-tensor kernel a
    device and dtype (a sum of squares a parameter was three kernels each, a host-bound GPU's time), squared in
    float64."""
    present = [i for i, d in enumerate(difference) if d is not None]
    out = torch.zeros(len(difference), dtype=torch.float64)
    if present:
        norms = torch._foreach_norm([difference[i] for i in present], 2, dtype=torch.float32)
        out[present] = _on_host(norms).double().square()
    return out if weighed is None else out * weighed


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
