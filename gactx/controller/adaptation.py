"""One adaptation: estimate sensitivities, agree on them across ranks, allocate bits under the budget."""

from __future__ import annotations

import logging
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gactx.config import Config, parse_bytes
from gactx.controller.allocator import WIDTHS, Allocation, Item, allocate
from gactx.controller.choices import calibration, choice_options
from gactx.controller.rules import ALLOCATED, ATTENTION_BITS
from gactx.controller.stats import PassStats

__all__ = ["Adaptation", "default_width", "reduce_across_ranks", "plan"]

logger = logging.getLogger(__name__)

# Widths a class allows, where not every width (see rules.py).
CLASS_WIDTHS = {"attention": tuple(w for w in WIDTHS if w >= ATTENTION_BITS)}


@dataclass(frozen=True)
class Adaptation:
    """What the last adaptation measured, chose and cost."""

    step: int
    passes: int  # forward+backward passes of the user's closure
    seconds: float  # wall time of the estimator and the allocator
    budget_bytes: int  # bytes allowed for the compressed tensors (kept tensors already subtracted)
    allocated_bytes: int
    predicted_variance: float  # sum C_l S(b_l) of the allocation
    feasible: bool


def default_width(average_bits: float) -> int:
    """Width of tensors the allocator has not seen yet: the widest code width within the average."""
    return max(w for w in WIDTHS if w <= average_bits)


def reduce_across_ranks(sensitivity: dict) -> dict:
    """Average the sensitivities over the ranks of ``torch.distributed`` so that every rank allocates the
    same bits. The ranks must have measured the same slots; otherwise a clear error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sensitivity
    slots = sorted(sensitivity, key=repr)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    fingerprint = zlib.crc32(repr(slots).encode())
    check = torch.tensor([fingerprint, -fingerprint], dtype=torch.float64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if check[0].item() != fingerprint or -check[1].item() != fingerprint:
        raise RuntimeError(
            "gactx: ranks measured different saved tensors; every rank must run the same model on "
            "batches of the same shape in the backprop closure"
        )
    values = torch.tensor([sensitivity[s] for s in slots], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values /= dist.get_world_size()
    return dict(zip(slots, values.tolist(), strict=True))


def plan(
    config: Config,
    last_pass: PassStats,
    sensitivity: dict,
    settled: frozenset = frozenset(),
    measured: dict | None = None,
    probed: dict | None = None,
) -> tuple[Allocation, int]:
    """Allocate widths to the tensors compressed in ``last_pass`` (the training forward), by slot.
    ``settled``: slots the estimator's passes stored with a fixed width or not at all (a mask, a pooling
    input whose op the training forward did not know yet): not allocated. ``measured``: by slot, the stored error
    of each choice (``choices.ChoiceMeter``); a measured tensor is offered every measured choice, the others uniform
    widths under the ``S(b)`` model. ``probed``: by slot, the gradient variance a choice was measured to add
    (``Estimate.probed``), which calibrates that choice's prediction. Returns the allocation and the bytes it was
    allowed for compressed tensors."""
    measured, probed = measured or {}, probed or {}
    items = []
    known = list(sensitivity.values())
    fallback = max(known) if known else 1.0  # a tensor the closure did not show: treat it as sensitive
    fixed = sum(n for n, _ in last_pass.kept_storages.values())
    for record in last_pass.records:
        if record.cls in ALLOCATED and isinstance(record.bits, int) and record.key[:3] not in settled:
            slot = record.key[:3]
            numel = torch.Size(record.key.shape).numel()
            c = sensitivity.get(slot, fallback)
            widths = CLASS_WIDTHS.get(record.cls)
            options = None
            if slot in measured and record.cls != "smooth":
                options = choice_options(
                    measured[slot], tuple(record.key.shape), record.dtype, config.group_size, config.probe_bits,
                    min(widths or WIDTHS), record.storage_bytes, calibration(measured[slot], probed.get(slot), c,
                    config.probe_bits),
                )  # fmt: skip
            items.append(
                Item(slot, numel, record.dtype, c, record.storage_bytes, widths, record.cls == "smooth", options)
            )
        elif isinstance(record.bits, int):
            fixed += record.packed_bytes  # masks, signs, dropout masks: a fixed width, lossless
    if config.budget is not None:
        budget = parse_bytes(config.budget) - fixed
    else:
        # The average width, or a class's narrowest where that is wider (attention: 4 bits at L2.2).
        budget = sum(
            int(it.numel * max(config.bits, min(it.widths or WIDTHS)) / 8) + 8 * -(-it.numel // config.group_size)
            for it in items
        )
    allocation = allocate(items, budget, config.group_size)
    if not allocation.feasible:
        message = (
            f"gactx: the budget ({budget} bytes for compressed tensors) is below what 1-bit codes need "
            f"({allocation.nbytes} bytes)"
        )
        if config.strict:
            raise ValueError(message + "; raise the budget or use strict=False to fall back to the narrowest widths")
        warnings.warn(message + "; using the narrowest widths", RuntimeWarning, stacklevel=4)
    return allocation, budget
