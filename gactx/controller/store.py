"""What a saved tensor becomes under its rule, and the handle autograd holds instead of it.

``encode`` turns a tensor into what its rule stores (see ``rules.py``): quantized codes, a mask or sign
code decoded to values on the right side of the op's own test, a FewBit code, nothing at all (values that
backward never reads), or the tensor itself. :class:`Packed` holds the result and decodes it on unpack.
"""

from __future__ import annotations

import math
import struct
import weakref
from dataclasses import dataclass

import torch

from gactx.controller.offload import HostCopy
from gactx.controller.policy import storage_ptr
from gactx.controller.rules import Rule, sketchable
from gactx.kernels import QuantizedTensor, dequantize, quantize
from gactx.kernels.codes import encode_bins, encode_codes, encode_compare
from gactx.kernels.fewbit import fewbit_table
from gactx.kernels.format import ALLOWED_BITS, FLOAT_DTYPES, as_is_width
from gactx.kernels.functional import choose_backend, quantize_checked
from gactx.kernels.schemes import Choice, scheme

__all__ = [
    "Kept",
    "Packed",
    "Unused",
    "as_is",
    "encode",
    "fewbit_tables",
    "mask_values",
    "modified_in_place",
    "stored_form",
    "unpack",
]


@dataclass(frozen=True, eq=False)
class Unused:
    """A tensor whose values backward never reads (pooling inputs): its layout only. Decodes to zeros."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int = 0
    bits: int = 0

    def decode(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).zero_()


def as_is(t: torch.Tensor) -> torch.Tensor:
    """A tensor kept as it is, without its autograd history. Returning a node's own output from the pack hook
    would make the node hold its output and the output hold the node: a cycle through C++ that Python's
    garbage collector cannot see, so a graph never run backward (an evaluation with grad enabled, a step
    abandoned after an exception) would never be freed. Autograd re-attaches the history on unpack."""
    return t.detach() if t.grad_fn is not None else t


def modified_in_place(t: torch.Tensor, saved: int) -> RuntimeError:
    """Autograd's own error for a saved tensor changed in place after its save. Saved-tensor hooks skip
    autograd's check of the saved tensor's version counter, so gactx makes it (the counter is read on the
    host: nothing synchronizes)."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {saved} instead. Hint: "
        "the tensor was saved for backward (and compressed by gactx); enable anomaly detection to find the "
        "operation that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True)."
    )


class Kept:
    """A tensor kept as it is (:func:`as_is` of the saved tensor: itself, or an alias sharing its version
    counter) and the version it had when saved: unpacked after an in-place change, it raises as autograd
    does."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version

    @classmethod
    def of(cls, t: torch.Tensor) -> Kept:
        """``t`` kept as it is (:func:`as_is`), at its version now."""
        return cls(as_is(t), t._version)

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise modified_in_place(self.tensor, self.version)
        return self.tensor


class Packed:
    """What autograd holds instead of a saved activation: what its rule stored (a ``QuantizedTensor``, its
    ``HostCopy`` in pinned CPU memory, a ``CodedTensor``, an ``Unused``, or a tensor kept as it is) and its
    key. A handle made while the model's op watcher runs holds the tensor itself until its op is known
    (one op later).

    A tensor that is still alive and unchanged when backward unpacks it (a batch the training loop holds,
    a graph's features, a tensor another op keeps as it is) is read from where it lives: its values cost
    nothing there, and backward then computes exactly what plain PyTorch computes. Unchanged: the same
    storage and version counter as at the save. The saved tensor itself changed in place since (its version
    counter moved, through it or a view sharing the counter): unpacking raises autograd's own error.
    Another storage swapped in (``.data = ...``, no version change), or a change to a base whose counter the
    saved tensor does not share: what was stored is decoded.
    """

    __slots__ = (
        "stored", "key", "source", "saved", "version", "through_base", "backend", "view", "decode", "__weakref__"
    )  # fmt: skip

    def __init__(self, stored, key, source: torch.Tensor, backend: str, ptr: int | None = None, decode=None) -> None:
        """``ptr``: the address of ``source``'s storage, where the caller has it already; ``decode``: what decodes
        ``stored`` (a replayed save's, bound once: ``replay.py``), else the stored form's own decoding."""
        base = source._base
        owner = source if base is None else base  # storage_owner(source), inlined: every save
        self.stored = stored
        self.key = key
        self.source = weakref.ref(owner)  # dedupe is valid only while the storage lives
        # The saved tensor's version counter, as autograd checks it: read from the tensor while it lives (its
        # Python object lives as long as the tensor does), else from its base if it was a view (a view shares
        # its base's counter); once both are gone nothing can change it.
        self.saved, self.version = weakref.ref(source), source._version
        self.through_base = base is not None
        self.backend = backend
        self.decode = decode
        ptr = storage_ptr(owner) if ptr is None else ptr
        self.view = (source.shape, source.stride(), source.storage_offset(), source.dtype, owner._version, ptr)

    def unpack(self) -> torch.Tensor:
        saved, owner = self.saved(), self.source()
        if saved is not None:
            if saved._version != self.version:
                raise modified_in_place(saved, self.version)
        elif self.through_base and owner is not None and owner._version != self.view[4]:
            raise modified_in_place(owner, self.view[4])  # the saved view is gone: its base's counter was its own
        s = self.stored
        if isinstance(s, torch.Tensor):
            return s
        if owner is not None:
            live = _still_alive(owner, self.view)
            if live is not None:
                return live
        if self.decode is not None:
            return self.decode(s)
        if isinstance(s, QuantizedTensor):
            return dequantize(s, backend=self.backend)
        if isinstance(s, HostCopy):
            s = s.offloader.fetch(s)
            if isinstance(s, QuantizedTensor):
                return dequantize(s, backend=self.backend)
        return s.decode()  # every other stored form: codes, a scheme's (gactx/kernels/schemes), nothing


def _still_alive(owner: torch.Tensor, view: tuple) -> torch.Tensor | None:
    """The saved tensor itself (``view`` of ``owner``, as :class:`Packed` holds it), if ``owner`` still holds it
    unchanged since the save (something outside gactx keeps it alive)."""
    shape, stride, offset, dtype, version, ptr = view
    if owner._version != version or owner.dtype != dtype or storage_ptr(owner) != ptr:
        return None
    return owner.detach().as_strided(shape, stride, offset)


def mask_values(rule: Rule, dtype: torch.dtype) -> tuple[float, float] | None:
    """The values a mask decodes to, in ``dtype``; ``None`` where the mask cannot be made exactly: then the
    tensor is kept. That is where ``dtype`` cannot hold a bound (0.7 in bfloat16: some kernels compare in
    the tensor's dtype, some in float32, so the test itself would depend on the kernel), or a true value
    strictly inside an open interval (hardtanh bounds closer than one step of ``dtype``). float32 tensors
    meet their bounds rounded to float32 in both the kernel and the mask."""
    if dtype in (torch.float16, torch.bfloat16):
        for bound in rule.pred[1:]:
            if bound is not None and round_to(bound, dtype) != bound:
                return None
    false_value, true_value = rule.values
    if rule.pred[0] == "between":  # float32 kernels compare with float32 bounds
        lo, hi = (round_to(b, torch.float32) for b in rule.pred[1:])
        inside = round_to(true_value, dtype)
        if not lo < inside < hi:
            return None
        true_value = inside
    return false_value, true_value


def round_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (to nearest, ties to even), in plain Python: no tensor is read."""
    if math.isnan(value) or math.isinf(value) or dtype == torch.float64:
        return value
    as32 = struct.unpack("<f", struct.pack("<f", value))[0] if abs(value) < 3.4e38 else math.copysign(math.inf, value)
    if dtype == torch.float16:
        try:
            return struct.unpack("<e", struct.pack("<e", as32))[0]
        except OverflowError:
            return math.copysign(math.inf, value)
    if dtype == torch.bfloat16:
        bits = struct.unpack("<I", struct.pack("<f", as32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return as32


def _predicate(t: torch.Tensor, pred: tuple) -> torch.Tensor:
    """The op's own test of ``t`` against its bounds (exactly representable in ``t``'s dtype, see
    :func:`mask_values`)."""
    kind = pred[0]
    if kind == "gt":
        return t > pred[1]
    if kind in ("between", "open"):  # "between" also decodes true to its midpoint (see mask_values)
        return (t > pred[1]) & (t < pred[2])
    if kind == "outside":
        return ~((t >= pred[1]) & (t <= pred[2]))
    lo, hi = pred[1], pred[2]  # "closed": each bound only where given
    if lo is not None and hi is not None:
        return (t >= lo) & (t <= hi)
    return t >= lo if lo is not None else t <= hi


def _compare_args(pred: tuple) -> tuple[str, float, float]:
    """:func:`_predicate`'s test as the C++ kernel's ``(kind, lo, hi)``."""
    kind, lo, hi = pred[0], pred[1], pred[2] if len(pred) > 2 else None
    if kind in ("between", "open"):
        kind = "open"
    elif kind == "closed" and (lo is None or hi is None):
        kind = "le" if lo is None else "ge"
    return kind, (0.0 if lo is None else lo), (0.0 if hi is None else hi)


_TABLES: dict[tuple, torch.Tensor] = {}
_FEWBIT: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (fn, params, bits, dtype, device) -> edges, points
_SIGNS = (0.0, 1.0, -1.0, math.nan)


def _table(values: tuple, dtype: torch.dtype, device: torch.device, name: tuple | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once for ``name`` (default: the values themselves, for a few of
    them: a key hashes every value at every save, and ``repr`` of a 255-value FewBit table is slow). Filled
    element by element on the device (``fill_`` takes the value as a kernel argument): a copy from pageable host
    memory, which ``table[i] = v`` is, would make the host wait for the CUDA stream."""
    key = (values if name is None else name, dtype, device)
    table = _TABLES.get(key)
    if table is None:
        table = torch.empty(len(values), dtype=dtype, device=device)
        for i, v in enumerate(values):
            table[i].fill_(v)
        table = _TABLES.setdefault(key, table)
    return table


def fewbit_tables(rule: Rule, bits: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The edges and points of the rule's FewBit table at ``bits`` on ``device``, named by the table's arguments."""
    key = (rule.fn, rule.fn_params, bits, dtype, device)
    found = _FEWBIT.get(key)
    if found is None:
        table = fewbit_table(rule.fn, rule.fn_params, bits)
        found = _FEWBIT[key] = (_table(table.edges, dtype, device, ("edges", *key[:3])),
                                _table(table.points, dtype, device, ("points", *key[:3])))  # fmt: skip
    return found


def encode(
    t: torch.Tensor, rule: Rule, bits: int | None, seed: int, group_size: int, stochastic: bool, backend: str,
    choice: Choice | None = None, site=None,
):  # fmt: skip
    """What ``rule`` stores for ``t`` at ``bits`` (the width chosen for quantized and FewBit classes); ``choice``:
    the scheme the allocation chose for a quantized class where not uniform codes (``adaptation/choices.py``),
    ``site``: the save's op (a sketch needs the input of a linear layer). ``t`` itself where the rule keeps it, or
    where a FewBit class or a scheme's fallback width saves nothing; a uniformly quantized width that saves nothing
    was kept by ``decide`` already (its reason, "as is"), and is not asked of this function."""
    kind = rule.kind
    if kind == "mask":
        values = mask_values(rule, t.dtype)
        if values is None:
            return as_is(t)
        table = _table(values, t.dtype, t.device)
        coded = encode_compare(t, *_compare_args(rule.pred), table, backend)  # C++: no bool tensor between
        return coded if coded is not None else encode_codes(_predicate(t, rule.pred), 1, table, backend)
    if kind == "sign":
        code = (t > 0).to(torch.uint8) + 2 * (t < 0).to(torch.uint8) + 3 * t.isnan().to(torch.uint8)
        return encode_codes(code, 2, _table(_SIGNS, t.dtype, t.device, ("signs",)), backend)  # NaN: not a key
    if kind == "unused":
        return Unused(t.shape, t.stride(), t.dtype, t.device)
    if kind == "dropout":
        # Values 0 and 1/(1-p): the mask and the scale, the largest value (a device scalar: no host read).
        scale = t.amax().reshape(1) if t.numel() else t.new_zeros(1)
        table = torch.cat([scale.new_zeros(1), scale])
        coded = encode_compare(t, "outside", 0.0, 0.0, table, backend)  # not 0 <= t <= 0: t != 0, NaN included
        return coded if coded is not None else encode_codes(t != 0, 1, table, backend)
    if kind == "keep" or bits is None:
        return as_is(t)
    if kind == "fewbit" and bits <= 8:
        edges, points = fewbit_tables(rule, bits, t.dtype, t.device)
        return encode_bins(t, edges, bits, points, backend)
    if kind == "quantize" and choice is not None:
        stored = _encode_choice(t, choice, seed, group_size, stochastic, backend, site)
        if stored is not None:
            return stored
        bits = choice.fallback_bits
    # A width that saves nothing: ``decide`` kept a uniformly quantized save at one already; a FewBit class at 16 or
    # 32 bits and a scheme's fallback width are this function's to keep.
    if (kind == "fewbit" or choice is not None) and as_is_width(bits, t.dtype):
        return as_is(t)
    if bits not in ALLOWED_BITS or t.dtype not in FLOAT_DTYPES:  # the checks quantize_checked skips
        return quantize(t, bits, group_size, stochastic=stochastic, seed=seed, backend=backend)
    return quantize_checked(t, bits, group_size, stochastic, seed, choose_backend(t, backend))


def _encode_choice(t: torch.Tensor, choice: Choice, seed: int, group_size: int, stochastic: bool, backend: str, site):
    """``t`` stored under a scheme other than uniform codes (``gactx/kernels/schemes``), or ``None`` where the scheme
    does not apply to this save (a graph that changed since the allocation: a sketch of a tensor that is no longer a
    linear layer's input)."""
    return scheme(choice.scheme).encode(
        t, choice, seed, group_size, stochastic, backend, site is not None and sketchable(site)
    )


def stored_form(stored, choice: Choice) -> str:
    """What a record says of a tensor stored under ``choice``: ``""`` for uniform codes (also where the choice did not
    apply and uniform codes were stored instead)."""
    if isinstance(stored, QuantizedTensor) and stored.scheme == "uniform":
        return ""
    return scheme(choice.scheme).form(choice)


def unpack(handle):
    """The unpack hook's eager work: the tensor a pack handle (:class:`Packed`, :class:`Kept`, a replayed save's C++
    handle: ``replay.py``) gives back; a tensor the pack hook returned itself as it is."""
    return handle if isinstance(handle, torch.Tensor) else handle.unpack()
