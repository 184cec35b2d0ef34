"""One adaptation: estimate sensitivities, agree on them across ranks, allocate bits under the budget."""

from __future__ import annotations

import dataclasses
import logging
import warnings
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gactx.config import Config, _caller_level, parse_bytes
from gactx.controller.adaptation.allocator import Allocation, Item, allocate, cost_of
from gactx.controller.adaptation.choices import calibration, choice_options
from gactx.controller.adaptation.ranks import collective_device, distributed
from gactx.controller.adaptation.widths import WIDTHS, variance_factor
from gactx.controller.rules import MIN_BITS
from gactx.controller.stats import AS_IS, PassStats

__all__ = [
    "Adaptation", "NOISE_CEILING", "allocate_estimate", "default_width", "noise_floor", "plan", "reduce_across_ranks"
]  # fmt: skip

logger = logging.getLogger(__name__)

# Widths a class allows, where not every width (see rules.py).
CLASS_WIDTHS = {cls: tuple(w for w in WIDTHS if w >= least) for cls, least in MIN_BITS.items()}
# A LayerNorm input that ActNN's estimator rated is given no width at which the rounding noise its normalized
# values carry, rho * S(b), exceeds their own variance times this (free_sensitivity's docstring).
NOISE_CEILING = 1.0


def noise_floor(widths: tuple[int, ...], rho: float) -> tuple[int, ...]:
    """``widths`` without those at which a LayerNorm input's normalized noise ``rho * S(b)`` exceeds
    :data:`NOISE_CEILING`."""
    return tuple(w for w in widths if rho * variance_factor(w) <= NOISE_CEILING)


@dataclass(frozen=True)
class Adaptation:
    """What the last adaptation measured, chose and cost."""

    step: int
    passes: int  # passes of the user's closure (a forward and a backward, or its backward replayed: replayed.py)
    seconds: float  # wall time of the estimator and the allocator
    budget_bytes: int  # bytes allowed for the compressed tensors (kept tensors already subtracted)
    allocated_bytes: int
    predicted_variance: float  # sum C_l S(b_l) of the allocation
    feasible: bool
    step_seconds: float | None = None  # a training step's wall time when it ran (``cost.StepClock``)
    share: float | None = None  # the share of training it takes at one adaptation every ``interval`` steps
    interval: int | None = None  # steps from this adaptation's interval start to the next one (schedule.py)
    stable: bool = False  # the allocation before it was within STABLE_VARIANCE of the new one's variance
    # Where the passes went: part -> (measurements, passes), GACT's estimator's (Estimate.parts), summed over the
    # adaptation's estimates; empty where no pass ran.
    passes_by_part: dict = field(default_factory=dict)
    partial_passes: int = 0  # of the passes, those that ran backward from the probed nodes down (replayed.PARTIAL)


def default_width(average_bits: float) -> int:
    """Width of tensors the allocator has not seen yet: the widest code width within the average."""
    return max(w for w in WIDTHS if w <= average_bits)


def reduce_across_ranks(sensitivity: dict, *tables: dict) -> dict | tuple[dict, ...]:
    """Average the sensitivities, and any tables of numbers by slot (``{slot: {name: number}}``: the measured
    errors of each choice, the probed variances), over the ranks of ``torch.distributed``, so that every rank
    allocates the same bits and choices. The ranks must have measured the same slots and names; otherwise a clear
    error. Returns the sensitivities alone where no table is given, else the sensitivities and each table."""
    if not distributed():
        return (sensitivity, *tables) if tables else sensitivity
    names = [(0, s, None) for s in sensitivity] + [
        (i, slot, name) for i, table in enumerate(tables, 1) for slot, row in table.items() for name in row
    ]
    names.sort(key=repr)
    device = collective_device()
    fingerprint = zlib.crc32(repr(names).encode())
    check = torch.tensor([fingerprint, -fingerprint], dtype=torch.float64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if check[0].item() != fingerprint or -check[1].item() != fingerprint:
        raise RuntimeError(
            "gactx: ranks measured different saved tensors; every rank must run the same model on "
            "batches of the same shape in the backprop closure (docs/adaptive.md#under-torchdistributed)"
        )
    source = (sensitivity, *tables)
    values = [source[i][slot] if i == 0 else source[i][slot][name] for i, slot, name in names]
    reduced = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    reduced /= dist.get_world_size()
    out: tuple[dict, ...] = ({}, *({} for _ in tables))
    for (i, slot, name), value in zip(names, reduced.tolist(), strict=True):
        if i == 0:
            out[0][slot] = value
        else:
            out[i].setdefault(slot, {})[name] = value
    return out if tables else out[0]


def plan(
    config: Config,
    last_pass: PassStats,
    sensitivity: dict,
    settled: frozenset = frozenset(),
    measured: dict | None = None,
    probed: dict | None = None,
    curves: dict | None = None,
    ratios: dict | None = None,
    previous: dict | None = None,
) -> tuple[Allocation, int]:
    """Allocate widths to the tensors compressed in ``last_pass`` (the training forward), by slot.
    ``settled``: slots the estimator's passes stored with a fixed width or not at all (a mask, a pooling
    input whose op the training forward did not know yet): not allocated. ``measured``: by slot, the stored error
    of each choice (``choices.ChoiceMeter``); a measured tensor is offered every measured choice, the others uniform
    widths under the ``S(b)`` model. ``probed``: by slot, the gradient variance a choice was measured to add
    (``Estimate.probed``), which calibrates that choice's prediction. ``curves``: by slot, the shape of a curved
    tensor's variance (``Estimate.curves``). ``ratios``: by slot, a LayerNorm input's normalized noise at
    ``S(b) = 1`` (``Estimate.ratios``): the widths at which it passes :data:`NOISE_CEILING` are not offered.
    ``previous``: by slot, the Choice an earlier allocation made, priced under this estimate as
    ``Allocation.kept_variance`` where it fits the budget. Returns the allocation and the bytes it was allowed for
    compressed tensors."""
    measured, probed, curves, ratios = measured or {}, probed or {}, curves or {}, ratios or {}
    items, metadata, storages = [], 0, {}
    known = list(sensitivity.values())
    fallback = max(known) if known else 1.0  # a tensor the closure did not show: treat it as sensitive
    # Kept storages are paid first, but for tensors kept at the 16 or 32 bits an allocation gave them: items again.
    fixed = sum(n for n, why in last_pass.kept_storages.values() if not why.endswith(f"({AS_IS})"))
    for record in last_pass.records:
        if record.allocated and record.key.slot not in settled:
            slot = record.key.slot
            numel = torch.Size(record.key.shape).numel()
            c = sensitivity.get(slot, fallback)
            widths = CLASS_WIDTHS.get(record.cls)
            # The average width of what plain PyTorch saves, each storage once (two saves of one tensor, a FewBit
            # code and quantized codes, share its bits), or a class's narrowest where that is wider (attention: 4
            # bits at L2.2); the metadata of each save's groups on top. A noise floor is paid from that budget.
            storage = record.storage or -len(items) - 1  # a compiled graph's value: a storage of its own
            width = max(config.bits, min(widths or WIDTHS))
            held = storages.get(storage, (0, 0))
            storages[storage] = (max(held[0], numel), max(held[1], width))
            metadata += 8 * -(-numel // config.group_size)
            if slot in ratios:
                widths = noise_floor(widths or WIDTHS, ratios[slot])
            response = curves.get(slot, (1.0, 0.0))
            options = None
            if slot in measured and record.cls != "smooth":
                options = choice_options(
                    measured[slot], tuple(record.key.shape), record.dtype, config.group_size, config.probe_bits,
                    min(widths or WIDTHS), record.storage_bytes, calibration(measured[slot], probed.get(slot), c,
                    config.probe_bits), response,
                )  # fmt: skip
            items.append(
                Item(
                    slot, numel, record.dtype, c, record.storage_bytes, widths, record.cls == "smooth", options,
                    response,
                )
            )  # fmt: skip
        elif record.compressed:
            fixed += record.packed_bytes  # masks, signs, dropout masks: a fixed width, lossless
    average = metadata + sum(int(numel * width / 8) for numel, width in storages.values())
    budget = parse_bytes(config.budget) - fixed if config.budget is not None else average
    allocation = allocate(items, budget, config.group_size)
    kept = cost_of(items, previous, config.group_size) if previous else None
    if kept is not None and kept[0] <= budget:
        allocation = dataclasses.replace(allocation, kept_variance=kept[1])
    if not allocation.feasible:
        basis = repr(config.budget) if config.budget is not None else f"{config.bits} bits an element on average"
        if config.budget is None:
            message = f"gactx: the budget ({basis}) is below what 1-bit codes need ({allocation.nbytes} bytes)"
        else:  # what cannot shrink, then the least budget that fits
            left = f"leaves {budget} bytes" if budget >= 0 else f"is {-budget} bytes short of what it holds"
            message = (
                f"gactx: the budget ({basis}) {left} for compressed tensors after {fixed} bytes of tensors kept or "
                f"stored at a fixed width, below what 1-bit codes need ({allocation.nbytes} bytes): the least "
                f"budget that fits is {fixed + allocation.nbytes} bytes"
            )
        if config.strict:
            raise ValueError(
                message + "; raise the budget or use strict=False to fall back to the narrowest widths "
                "(docs/levels.md#budgets)"
            )
        warnings.warn(
            message + "; using the narrowest widths (docs/levels.md#budgets)",
            RuntimeWarning,
            stacklevel=_caller_level(),
        )
    return allocation, budget


def allocate_estimate(
    config: Config, estimate, eager: PassStats, discovered: PassStats, previous: dict | None = None
) -> tuple[dict, Allocation, int]:
    """One adaptation's allocation from an estimate (``sensitivity.Estimate``): agreed across ranks, then :func:`plan`
    for the saves of ``eager`` (the training pass, or the estimator's first pass where training ran compiled graphs).
    ``discovered``: the estimator's first pass; ``previous``: the allocation before, by slot (:func:`plan`). Returns
    the sensitivities (averaged over the ranks), the allocation and its budget."""
    # Every rank allocates alike: what the allocation reads is averaged over the ranks (a curve as its two parts).
    absolute = {s: {"a": estimate.sensitivity[s] * a, "q": estimate.sensitivity[s] * q} for s, (a, q) in
                estimate.curves.items()}  # fmt: skip
    ratios = {s: {"rho": r} for s, r in estimate.ratios.items()}
    sensitivity, measured, probed, absolute, ratios = reduce_across_ranks(
        estimate.sensitivity, estimate.measured, estimate.probed, absolute, ratios
    )
    curves = {s: (p["a"] / sensitivity[s], p["q"] / sensitivity[s]) for s, p in absolute.items()
              if sensitivity[s] > 0}  # fmt: skip
    # A training forward that met an op for the first time stored its tensors as linear inputs; the estimator's
    # passes, watched, know better where they stored one at a fixed width.
    settled = frozenset(r.key.slot for r in discovered.records if not r.allocated)
    allocation, budget = plan(
        config, eager, sensitivity, settled - set(sensitivity), measured, probed, curves,
        {s: r["rho"] for s, r in ratios.items()}, previous,
    )  # fmt: skip
    return sensitivity, allocation, budget
