"""Several tensors probed in one pass, told apart by where in the gradient their noise lands.

A tensor probed alone against the base pass (``sensitivity.py``) leaves ``||g - g_base||^2`` spread over the
parameters' gradients in a pattern of its own: its *profile*, the share of that squared distance in each parameter's
gradient. The input of a block's last normalisation reaches that block's weights and everything before it; the
probabilities of a head's attention reach its projections first. An estimate keeps each tensor's profile, and a later
one probes tensors whose profiles overlap little in one pass: their noises are independent, so their variances add in
every parameter's gradient, ``D_j = sum_i s_i u_ij``, where ``u_ij`` is what tensor ``i`` put in parameter ``j`` last
time, rescaled to the noise it is probed at now, and ``s_i`` how much its sensitivity moved since. The scales are the
weighted least-squares solution of those equations, each parameter's equation weighted by one over what it is expected
to hold (its noise is relative).

Tensors go together only where each keeps most of what it puts in the gradient to itself (:data:`PURITY`): a
tensor's purity in a group is ``sum_j u_ij^2 / sum_k u_kj`` over ``sum_j u_ij``, 1 where no other member reaches its
parameters. A group whose solution is not positive, or whose pass puts a sizeable share of its squared distance where
no member is expected (:data:`UNEXPLAINED`: a profile that no longer holds), is probed alone, tensor by tensor, and
their profiles measured afresh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "GROUPED", "PURITY", "UNEXPLAINED", "Profiles", "form_groups", "layout_of", "parts", "probe_in_groups", "solve",
]  # fmt: skip

# Probe tensors with kept profiles in groups (estimate_sensitivities); False: each alone, as in the first estimate.
GROUPED = True
# The least purity every member of a group keeps (module docstring). On the character-level transformer, BERT-base
# and ResNet-50 (small), 0.6 put 18, 18 and 53 tensors into 7, 8 and 36 passes, and the sensitivities' spread from an
# independent estimate was what two estimates of tensors probed alone show (docs/adaptive.md).
PURITY = 0.6
# The largest share of a group pass's squared distance that may land where no member's profile put any.
UNEXPLAINED = 0.1


@dataclass(frozen=True)
class Profiles:
    """Each probed tensor's profile (its share of ``||g - g_base||^2`` in each parameter's gradient, summing to 1) and
    its sensitivity when the profile was last measured or scaled, on one ``layout`` of the flat gradient."""

    layout: tuple[int, ...] = ()  # ids of the parameters whose gradients the flat gradient holds, in order
    sizes: tuple[int, ...] = ()
    shares: Mapping[Hashable, torch.Tensor] = field(default_factory=dict)
    sensitivity: Mapping[Hashable, float] = field(default_factory=dict)


def layout_of(model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids and sizes of the parameters that hold a gradient, in ``model.parameters()`` order: the flat gradient's
    layout (``sensitivity._gradient``)."""
    params = [p for p in model.parameters() if p.grad is not None]
    return tuple(id(p) for p in params), tuple(p.numel() for p in params)


def parts(diff: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The squared norm of a flat gradient difference in each parameter's range, on the host (float64)."""
    return torch.stack([piece.dot(piece) for piece in diff.split(sizes)]).cpu()


def form_groups(expected: Mapping[Hashable, torch.Tensor], purity: float = PURITY) -> list[list[Hashable]]:
    """Greedy groups of the slots of ``expected`` (slot -> what its probe is expected to put in each parameter's
    gradient): largest first, each into the first group where every member's purity stays at least ``purity``."""
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
    weight = 1.0 / total[reached]
    scales = torch.linalg.lstsq(a[reached] * weight[:, None], (measured[reached] * weight)[:, None]).solution[:, 0]
    if not bool(torch.isfinite(scales).all()):
        return None, everyone
    kept = _purity((a * scales.clamp_min(0)).T)
    out = [i for i in everyone if float(scales[i]) <= 0 or float(kept[i]) < purity]
    return (None, out) if out else (scales.tolist(), [])


def solve(expected: list[torch.Tensor], measured: torch.Tensor, purity: float = PURITY) -> list[float] | None:
    """The scale of each member's expected contribution that together explain ``measured`` (a group pass's squared
    distance in each parameter's gradient), by least squares weighted by one over the expected total; ``None`` where a
    scale is not positive and finite, more than :data:`UNEXPLAINED` of the distance lands where none is expected, or
    a member's purity among the contributions found is below ``purity`` (a sensitivity that moved since the profiles
    were kept: the group was formed on magnitudes that no longer hold)."""
    return _fit(expected, measured, purity)[0]


def probe_in_groups(
    members: Mapping[Hashable, tuple[object, float]],
    profiles: Profiles | None,
    layout: tuple[int, ...],
    run: Callable[[dict], torch.Tensor],
) -> tuple[dict, dict, int]:
    """Probe in groups the ``members`` (slot -> ``(probe, noise)``: the probe it takes alone against the base, and the
    squared distance that adds per unit of sensitivity) whose profiles were kept on this ``layout``; ``run(probes)``
    runs one pass with those probes and returns its :func:`parts` against the base. A group the pass does not explain
    (:func:`_fit`) has the members it names probed alone, each drawn as in the group's pass, so that what each put
    there is taken out of it, and the rest solved again. Returns ``(slot -> sensitivity, slot -> profile measured
    afresh, passes)`` for the members measured so; the others are left to be probed alone."""
    if not GROUPED or profiles is None or profiles.layout != layout:
        return {}, {}, 0
    expected = {}
    for slot, (_, noise) in members.items():
        c = profiles.sensitivity.get(slot)
        if slot in profiles.shares and c is not None and math.isfinite(c) and c > 0 and noise > 0:
            expected[slot] = c * noise * profiles.shares[slot]
    found, shares, passes = {}, {}, 0
    for group in form_groups(expected):
        if len(group) < 2:
            continue
        measured = run({s: members[s][0] for s in group})
        passes += 1
        while group:
            scales, out = _fit([expected[s] for s in group], measured, PURITY)
            if scales is not None:
                found.update((s, k * profiles.sensitivity[s]) for s, k in zip(group, scales, strict=True))
                break
            for slot in [group[i] for i in out]:
                alone = run({slot: members[slot][0]})
                passes += 1
                whole = float(alone.sum())
                found[slot] = whole / members[slot][1]
                if whole > 0 and math.isfinite(whole):
                    shares[slot] = alone / whole
                measured = (measured - alone).clamp_min(0.0)
                group.remove(slot)
    return found, shares, passes
