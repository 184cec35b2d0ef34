"""Tensors whose noise reaches only their own weights' gradients, probed all at once (``sensitivity.py``).

Backward reads the activation operand of a product or a convolution with a weight only for that weight's gradient
(``grad_W = g^T x``), so the noise of every such tensor lands in its own weight's part of the gradient and nowhere
else: one pass (or a pair) probes them all, and each one's share is read from its weights' part.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gactx.controller.adaptation.groups import Weights, parts
from gactx.controller.adaptation.probe import Probe
from gactx.controller.adaptation.widths import variance_factor

__all__ = ["probe_together", "weight_blocks"]


def weight_blocks(model: nn.Module, weights: dict) -> dict:
    """``slot -> positions`` in the gradient's layout (``sensitivity._gradient``) of each slot's weights, for the
    slots whose weights no other slot claims; the others are left out."""
    claims: dict[int, int] = {}
    for params in weights.values():
        for p in params:
            claims[id(p)] = claims.get(id(p), 0) + 1
    # the parameters the discovering pass gave a gradient: the gradient's layout
    position = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.grad is not None)}
    out = {}
    for slot, params in weights.items():
        if params and all(claims[id(p)] == 1 and id(p) in position for p in params):
            out[slot] = tuple(position[id(p)] for p in params)
    return out


def probe_together(
    gradient: Callable[[], list[torch.Tensor]],
    set_probe,
    plans: dict,
    blocks: dict,
    probe_bits: int,
    seed_of,
    against=None,
    exact: bool = False,
    weights: Weights | None = None,
):
    """Probe every slot of ``blocks`` at once: a pair of passes for the probe width and one for each storage choice
    pair, each slot with its own seeds (those it would have alone). A slot's noise reaches only its weights' gradients
    (a weight's gradient reads the saved operand linearly, and no other gradient reads it), so the two gradients
    differ in its weights' ranges by its noise alone, exactly as when it is probed alone, and nowhere else. Returns
    ``((sensitivities, probed), passes)``, or ``(None, passes)`` where the gradients also differ elsewhere (a weight
    shared beyond what the slots say, a nondeterministic backward): then each slot is probed alone. ``gradient()``
    runs a pass. ``against``: ``(probes -> the squared distance of a pass with them from the base pass in each
    parameter's gradient, each slot's context)``, where every slot's context is known: then one pass with every slot
    probed, against the base, instead of the pair
    (``sensitivity.estimate_sensitivities``); ``exact``: the base is exact, and each storage choice's first is measured
    against it too, not by a pair. ``weights``: the estimate's weights of each parameter's squared distance, set by the
    first gradient ``gradient()`` gives (``groups.Weights``)."""

    def pair(probes: list[dict]) -> torch.Tensor:
        """The squared distance in each parameter (weighed) between a pass with each of the two ``probes``."""
        grads = []
        for mapping in probes:
            set_probe(mapping)
            grads.append(gradient())
        return parts(grads[0], grads[1], None if weights is None else weights.vector)

    def spread(each: torch.Tensor, scale: float, members) -> dict | None:
        total, found = float(each.sum()), {}  # a host read, outside any hook: once per pass
        for slot in members:
            found[slot] = sum(float(each[i]) for i in blocks[slot])
        inside = sum(found.values())
        if not (math.isfinite(total) and abs(total - inside) <= 1e-6 * total):
            return None
        return {slot: scale * v for slot, v in found.items()}

    if against is None:
        passes = 2
        first = spread(pair([{s: Probe(s, probe_bits, seed_of(s, j)) for s in blocks} for j in (1, 2)]), 0.5,
                       blocks)  # fmt: skip
        if first is None:
            return None, passes
        raw = {slot: v / variance_factor(probe_bits) for slot, v in first.items()}
    else:
        distance, context = against
        passes = 1
        first = spread(distance({s: Probe(s, probe_bits, seed_of(s, 1)) for s in blocks}), 1.0, blocks)
        if first is None:
            return None, passes
        raw = {slot: v / (variance_factor(probe_bits) + context[slot]) for slot, v in first.items()}
    probed: dict = {}
    for n in range(max(len(plans[s][1]) for s in blocks)):
        members = [s for s in blocks if len(plans[s][1]) > n]
        seeds = {s: seed_of(s, 2 + 1 + n) for s in members}
        probes = [{s: Probe(s, plans[s][1][n][k].bits, seeds[s], plans[s][1][n][k]) for s in members} for k in (0, 1)]
        if exact and against is not None:  # the first against the exact base
            passes += 1
            found = spread(against[0](probes[0]), 1.0, members)
        else:
            passes += 2
            found = spread(pair(probes), 0.25, members)
        if found is None:
            return None, passes
        for s in members:
            probed.setdefault(s, {}).setdefault(plans[s][1][n][0], []).append(found[s])
    probed = {s: {c: sum(v) / len(v) for c, v in row.items()} for s, row in probed.items()}
    return (raw, probed), passes
