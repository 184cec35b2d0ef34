"""A save done again: what the pack path decided for a key in one pass, redone for the next pass's save of it.

A training loop saves the same tensors in the same order, step after step, under the same plan. The first save of a
key goes the whole path (``pack.py``): the policy, the site learned for its slot, the decision, the store's choice of
kernel, the record. Where that save was stored by its rule alone (no scheme the allocation chose, no probe, nothing
offloaded) and no other save of its storage came first, its key keeps a :class:`Replay`: the rule's encoder with its
arguments bound (``bound_quantize``, ``bound_encode_bins`` of the kernels), and the record. The next pass's save of
the same key (slot and shape) with the same dtype, device and ``grad_fn`` node is encoded, recorded and handed back by
:meth:`Replay.pack` without the rest: what the whole path would do, in fewer steps. Its storage is new to the pass, or
an earlier save of the pass holds it in another form (a ReLU's mask of the tensor a convolution then saves as its
input) and no save of the pass stored this view in this form (the whole path would share that one) or kept it as it
is (then another view of it costs nothing).

A replayed save registers its handle for later saves of the same tensor (the pack path's dedupe table) only where a
later save shared what the whole path stored for it: the entry and its weak reference to the storage cost more than
the rest of the replay's bookkeeping, and a pass that repeats has no other save to find it.

What a replay must not outlive, the pack path drops: every replay when the plan's widths, schemes or probe change
(only the step's seed changes from one step to the next) or a watched pass learns the model's ops again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from gactx.controller.decide import Decision
from gactx.controller.identity import Key
from gactx.controller.plan import GOLDEN, MASK62, Plan
from gactx.controller.rules import ALLOCATED, Site
from gactx.controller.stats import KeyRecord, PassStats
from gactx.controller.store import Packed, encode, fewbit_tables, modified_in_place
from gactx.kernels import cpu
from gactx.kernels.codes import CodedTensor, bound_decode_codes, bound_encode_bins, native_encode_bins
from gactx.kernels.format import ALLOWED_BITS, FLOAT_DTYPES, QuantizedTensor
from gactx.kernels.functional import bound_dequantize, bound_quantize, native_quantize

__all__ = ["Replay", "replayable"]

REPLAYED_KINDS = ("quantize", "fewbit", "mask", "sign", "dropout")  # rules whose encoding depends on dtype and width


def replayable(decision: Decision, plan: Plan) -> bool:
    """Whether a save stored under ``decision`` can be replayed: by its rule alone, not under a scheme the allocation
    chose or a probe (the noise seed of a replay is the step's)."""
    rule = decision.rule
    return (
        rule is not None
        and not decision.reason
        and decision.choice is None
        and rule.kind in REPLAYED_KINDS
        and plan.probe is None
    )


class Replay:
    """One key's save, as the whole path stored it (see the module docstring). ``pack`` does it again."""

    __slots__ = (
        "dtype", "node", "device", "encode", "decode", "native", "weyl", "claims", "observed", "record", "form",
        "decision", "backend", "shared", "factor", "launched",
    )  # fmt: skip

    def __init__(
        self, t: torch.Tensor, site: Site | None, decision: Decision, number: int, config, record: KeyRecord, stored
    ) -> None:
        """``t`` saved at ``site``, stored under ``decision`` (as ``stored``) as the save numbered ``number`` (its noise
        seed's part), with the controller's ``config``, and recorded as ``record``."""
        self.dtype, self.node, self.device = t.dtype, type(t.grad_fn), t.device
        self.encode: Callable[[torch.Tensor, int], object] = _encoder(t, site, decision, config)
        self.decode = _decoder(stored, config.backend)
        self.native = _native(t, decision, config)
        self.launched = bool(getattr(self.native, "launching", False))  # by native launches (gactx.kernels.native)
        self.weyl = (number + 1) * GOLDEN  # Plan.seed's part of the save's number
        self.claims = site is not None and site.result and t.grad_fn is not None
        self.observed = decision.rule.cls in ALLOCATED  # what the pack path's observers are shown
        self.record = record  # the last record of the save: what the next one repeats, storage aside
        self.form, self.decision, self.backend = decision.rule.form, decision, config.backend
        # Whether a later save of the pass shared what this one stored (the pack path's dedupe): only then does a
        # replayed save register its handle for later saves to find.
        self.shared = False
        # Whether a later save of the pass is the product of this one and another (product.py): then a replayed save
        # remembers its handle on its autograd node for that save to find (mark_factor).
        self.factor = False

    def mark_factor(self) -> None:
        """A later save is the product of this one and another: its replays go the Python way (no C++ packer, which
        the C++ lane would take whole), where the pack path remembers their handles (``product.remember``)."""
        self.factor, self.native, self.launched = True, None, False

    def pack(self, t: torch.Tensor, key: Key, ptr: int, stats: PassStats, plan: Plan):
        """Encode ``t`` (its storage at ``ptr``) with the step's seed, record it in ``stats``, and return its handle:
        the C++ one where a packer of its own is bound and no later save shares what it stores (those find a
        :class:`~gactx.controller.store.Packed` in the pack path's dedupe table), else a ``Packed``."""
        seed = (plan.seed_base + self.weyl) & MASK62
        handle = None if self.native is None or self.shared else self.native(t, seed)
        if handle is None:
            handle = Packed(self.encode(t, seed), key, t, self.backend, ptr, self.decode)
        self.record = stats.record_replayed(t, key, ptr, self.record)
        return handle


def _encoder(t: torch.Tensor, site: Site | None, decision: Decision, config) -> Callable[[torch.Tensor, int], object]:
    """``encode`` of the decision's rule and width, its arguments bound, called as ``encoder(t, seed)``: the kernel's
    own call for uniform codes and FewBit codes, ``store.encode`` for the other rules."""
    rule, bits = decision.rule, decision.bits
    if rule.kind == "quantize" and bits in ALLOWED_BITS and t.dtype in FLOAT_DTYPES:
        return bound_quantize(t, bits, config.group_size, config.stochastic, config.backend)
    if rule.kind == "fewbit" and bits <= 8:
        edges, points = fewbit_tables(rule, bits, t.dtype, t.device)
        return bound_encode_bins(t, edges, bits, points, config.backend)
    return partial(_encode, rule, bits, config.group_size, config.stochastic, config.backend, site)


def _native(t: torch.Tensor, decision: Decision, config):
    """The C++ packer of the decision's rule and width (``csrc/saved.h``: the encoding and the handle in one call, the
    handle's unpack one call too), for uniform codes and FewBit codes of CPU tensors; ``None`` elsewhere."""
    rule, bits = decision.rule, decision.bits
    packer = None
    if rule.kind == "quantize" and t.dtype in FLOAT_DTYPES:
        packer = native_quantize(t, bits, config.group_size, config.stochastic, config.backend)
    elif rule.kind == "fewbit" and bits <= 8:  # wider: stored as is (``_encoder``'s test)
        edges, points = fewbit_tables(rule, bits, t.dtype, t.device)
        packer = native_encode_bins(t, edges, bits, points, config.backend)
    if packer is not None:
        cpu.built.set_modified_error(modified_in_place)  # what its handles raise, as Packed does
    return packer


def _decoder(stored, backend: str) -> Callable | None:
    """What decodes what the replay stores, bound once (``bound_dequantize``, ``bound_decode_codes`` of the kernels);
    ``None`` for the other stored forms (the handle asks them)."""
    if isinstance(stored, QuantizedTensor):
        return bound_dequantize(stored, backend)
    if isinstance(stored, CodedTensor):
        return bound_decode_codes(stored)
    return None


def _encode(rule, bits, group_size, stochastic, backend, site, t, seed):
    return encode(t, rule, bits, seed, group_size, stochastic, backend, None, site)
