"""Bytes held for the saved tensors of one forward pass, before and after compression, and the report.

"Before" is what plain PyTorch would hold: the storages of the saved activations, each counted once
(parameters and buffers are not activation memory and are left out of both sides). "After" is what gactx
holds: every compressed handle once, plus the storages of the activations it kept as they were.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from gactx.controller.identity import Key
from gactx.controller.rules import ALLOCATED

AS_IS = "as is"  # the reason of a tensor stored as it is at the width it was given (16 or 32 bits)
EXACT = "exact"  # ... of one a probe pass keeps as it is to measure another (plan.Plan.exact): not recorded
__all__ = ["CompiledRun", "MemoryStats", "PassStats", "KeyRecord", "format_bytes"]


@dataclass(frozen=True)
class MemoryStats:
    """Saved-activation memory of the most recent forward pass.

    Attributes:
        original_bytes: what plain PyTorch would have held (unique storages of saved activations).
        packed_bytes: what gactx holds (compressed handles and kept tensors, each once).
        kept_bytes: the part of ``packed_bytes`` held by tensors kept as they were.
        tensors: distinct saved activations (a tensor saved several times counts once).
        compressed: how many of them were compressed (bool masks included).
        kept: how many were kept as they were (small, integer, float64, ...).
        deduplicated: saves answered with a handle already made in this pass.
        offloaded_bytes: the part of ``packed_bytes`` waiting in pinned CPU memory (level L3 or
            ``offload=True``, CUDA tensors); the device holds ``device_bytes``.
        kept_by_reason: ``kept_bytes`` by why they were kept (``"small"``, ``"dtype int64"``, an op class such as
            ``"equality"``, ``"32 (as is)"``), largest first.
    """

    original_bytes: int = 0
    packed_bytes: int = 0
    kept_bytes: int = 0
    tensors: int = 0
    compressed: int = 0
    kept: int = 0
    deduplicated: int = 0
    offloaded_bytes: int = 0
    kept_by_reason: dict[str, int] = field(default_factory=dict, hash=False)

    @property
    def ratio(self) -> float:
        """``original_bytes / packed_bytes`` (1.0 when nothing was saved)."""
        return self.original_bytes / self.packed_bytes if self.packed_bytes else 1.0

    @property
    def device_bytes(self) -> int:
        """What gactx holds on the tensors' device: ``packed_bytes - offloaded_bytes``."""
        return self.packed_bytes - self.offloaded_bytes


@dataclass(slots=True)
class KeyRecord:
    """One save of a pass: its key, what it was and what was stored (a :class:`~gactx.controller.decide.Decision`'s
    width and reason, the bytes before and after)."""

    key: Key
    dtype: torch.dtype
    bits: int | None  # the width it was stored at, or given where stored as it is at 16 or 32 bits; else None
    original_bytes: int  # the tensor's own bytes
    packed_bytes: int
    storage_bytes: int  # bytes of its storage that keeping it holds (see counted_range)
    op: str = ""  # the aten op that saved it, and the argument or result when not self/result
    cls: str = ""  # its rule's class (see rules.py)
    form: str = ""  # how it was stored where not uniform codes: "normal", "sketch 1/4" (see adaptation/choices.py)
    reason: str = ""  # why it was kept as it is ("small", "kept", "as is", "L0", ...); "" where it was stored
    storage: int = 0  # its storage's number in the pass (saves of one storage share it); 0: a storage of its own

    @property
    def compressed(self) -> bool:
        """Whether something other than the tensor itself was stored (codes, a mask, nothing at all)."""
        return not self.reason

    @property
    def allocated(self) -> bool:
        """Whether its width is the allocator's to choose: a class the allocator serves, given a width (stored at it,
        or as it is because the width given was 16 or 32 bits)."""
        return self.bits is not None and self.cls in ALLOCATED

    @property
    def label(self) -> str:
        """What the report's bits column says: the width, ``"32 (as is)"``, or why the tensor was kept (nothing for a
        save stored with no width of its own: a product of two others)."""
        if not self.reason:
            return "" if self.bits is None else str(self.bits)
        return self.reason if self.bits is None else f"{self.bits} ({self.reason})"

    @property
    def why_kept(self) -> str:
        """What the kept bytes of a save kept as it is are counted under (``PassStats.kept_by_reason``)."""
        return self.cls if self.reason == "kept" else self.label


@dataclass(frozen=True)
class CompiledRun:
    """The saves of one run of a compiled graph, ``(record, compressed)`` each, summed once: a graph runs again with the
    same ones step after step (:meth:`PassStats.add_compiled_run`)."""

    records: tuple[KeyRecord, ...]
    original_bytes: int
    compressed: int
    packed_bytes: int  # of the compressed ones
    kept: int
    kept_bytes: tuple[tuple[int, str], ...]  # of the kept ones: (bytes, why kept) for each reason

    @classmethod
    def of(cls, saves: list[tuple[KeyRecord, bool]]) -> CompiledRun:
        kept: dict[str, int] = {}
        for record, compressed in saves:
            if not compressed:
                kept[record.why_kept] = kept.get(record.why_kept, 0) + record.packed_bytes
        return cls(
            tuple(record for record, _ in saves),
            sum(record.original_bytes for record, _ in saves),
            sum(1 for _, compressed in saves if compressed),
            sum(record.packed_bytes for record, compressed in saves if compressed),
            sum(1 for _, compressed in saves if not compressed),
            tuple((nbytes, why) for why, nbytes in kept.items()),
        )


@dataclass
class PassStats:
    """Accumulates one forward pass. Holds integers and keys only, never tensors."""

    # storage address -> (a tensor on it, the byte ranges of it that saved tensors cover, its number). An address names
    # one storage only while that storage lives: once a compressed original is freed, the allocator hands
    # its address to new tensors, which are new storages (numbered apart: ``storages`` counts them).
    live: dict[int, tuple[weakref.ref, list, int]] = field(default_factory=dict)
    storages: int = 0
    kept_ranges: dict[int, list] = field(default_factory=dict)  # address -> byte ranges of kept views
    original_bytes: int = 0
    kept_storages: dict[int, tuple[int, str]] = field(default_factory=dict)  # address -> (bytes, why kept)
    packed_bytes: int = 0
    compressed: int = 0
    kept: int = 0
    deduplicated: int = 0
    records: list[KeyRecord] = field(default_factory=list)
    held: dict[int, weakref.ref] = field(default_factory=dict)  # storages kept as is: address -> owner
    offloaded_bytes: int = 0
    graph_runs: dict = field(default_factory=dict)  # compiled forward graph -> its run under way (compiled.py)

    def record(
        self, t: torch.Tensor, key: Key, ptr: int, site, rule, bits: int | None, reason: str, stored=None,
        offloaded: bool = False, form: str = "",
    ) -> None:  # fmt: skip
        """The one record of a save of ``t`` (its storage at ``ptr``): its key, op (``site``), rule, width and reason,
        and ``stored``, what was stored (``None`` where ``t`` is kept as it is: ``reason`` says why). Before and after
        count each storage once, and of a view of data that lives anyway (a batch sliced from a dataset,
        ``X[:64]``) the bytes it covers, not ``X``."""
        nbytes = t.numel() * t.element_size()
        span = counted_range(t)
        compressed = stored is not None
        op, cls = ("" if site is None else site.label), ("" if rule is None else rule.cls)
        packed = stored.nbytes if compressed else nbytes
        owner = weakref.ref(t if t._base is None else t._base)  # storage_owner(t), inlined: every save runs it
        seen = self.live.get(ptr)
        if seen is None or seen[0]() is None:
            self.storages += 1
            seen = self.live[ptr] = (owner, [], self.storages)
            self.kept_ranges.pop(ptr, None)
        record = KeyRecord(key, t.dtype, bits, nbytes, packed, span[1] - span[0], op, cls, form, reason, seen[2])
        if compressed and not seen[1]:  # a storage first saved here, compressed (most saves): _cover, _count inlined
            start, end = span
            if end > start:
                seen[1].append(span)
                self.original_bytes += end - start
            self.records.append(record)
            self.compressed += 1
            self.packed_bytes += packed
            if offloaded:
                self.offloaded_bytes += packed
            return
        self._count(record, compressed, offloaded, ptr, self._cover(t, ptr, not compressed, span))
        if not compressed:
            self.held[ptr] = owner

    def record_replayed(self, t: torch.Tensor, key: Key, ptr: int, like: KeyRecord) -> KeyRecord:
        """:meth:`record` of a compressed save stored as the save of ``like`` was (a replayed save, see ``replay.py``):
        its storage new to the pass, or held by an earlier save of it in another form (a ReLU's mask of what a
        convolution saves as its input), counted once either way. Its record, ``like`` itself where nothing differs."""
        base = t._base
        if base is None:  # counted_range(t) of a tensor that is no view (most saves), inlined
            start, end = span = 0, t.untyped_storage().nbytes()
        else:
            start, end = span = counted_range(t)
        covered = end - start
        seen = self.live.get(ptr)
        if seen is None or seen[0]() is None:
            self.storages += 1
            number = self.storages
            self.live[ptr] = (weakref.ref(t if base is None else base), [span] if covered > 0 else [], number)
            if self.kept_ranges:
                self.kept_ranges.pop(ptr, None)
            added = covered
        else:
            number, added = seen[2], cover(seen[1], start, end)
        record = like
        if like.storage != number or like.storage_bytes != covered:  # like.key == key: replays are by key
            record = KeyRecord(key, like.dtype, like.bits, like.original_bytes, like.packed_bytes, covered, like.op,
                               like.cls, like.form, like.reason, number)  # fmt: skip
        self.records.append(record)
        self.original_bytes += added
        self.compressed += 1
        self.packed_bytes += record.packed_bytes
        return record

    def extend(self, t: torch.Tensor, ptr: int) -> None:
        """Another view of a storage this pass keeps as it is (no record of its own): a deduplicated save, and the
        bytes it covers that no saved view covered yet."""
        self.deduplicated += 1
        added = self._cover(t, ptr, True) if ptr in self.live else 0
        if added:
            held, why = self.kept_storages.get(ptr, (0, "kept"))
            self.kept_storages[ptr] = (held + added, why)

    def _cover(self, t: torch.Tensor, ptr: int, kept: bool, span: tuple[int, int] | None = None) -> int:
        """Add what ``t`` covers of its storage to the pass's original bytes; return what it adds to the kept
        bytes (``kept``: it is kept as it is)."""
        start, end = counted_range(t) if span is None else span
        self.original_bytes += cover(self.live[ptr][1], start, end)
        return cover(self.kept_ranges.setdefault(ptr, []), start, end) if kept else 0

    def add_compiled(self, record: KeyRecord, compressed: bool) -> None:
        """A save of a compiled graph: a value the graph made, its own storage (no other save shares it, and it has no
        address: a key of its own among the kept storages)."""
        self.original_bytes += record.original_bytes
        self._count(record, compressed, False, -len(self.records) - 1, record.packed_bytes)

    def add_compiled_run(self, run: CompiledRun) -> None:
        """The saves of a compiled graph's run (:meth:`add_compiled` each), summed once for runs like it."""
        first = len(self.records)
        self.records += run.records
        self.original_bytes += run.original_bytes
        self.compressed += run.compressed
        self.packed_bytes += run.packed_bytes
        self.kept += run.kept
        for k, kept in enumerate(run.kept_bytes):  # keys of their own, as add_compiled's: one for each reason
            self.kept_storages[-first - k - 1] = kept

    def _count(self, record: KeyRecord, compressed: bool, offloaded: bool, storage: int, kept_bytes: int) -> None:
        self.records.append(record)
        if compressed:
            self.compressed += 1
            self.packed_bytes += record.packed_bytes
            if offloaded:
                self.offloaded_bytes += record.packed_bytes
        else:
            self.kept += 1
            held, why = self.kept_storages.get(storage, (0, record.why_kept))
            self.kept_storages[storage] = (held + kept_bytes, why)

    def holds(self, ptr: int) -> bool:
        """Whether a storage at ``ptr`` is kept as is in this pass (then more views of it cost nothing)."""
        owner = self.held.get(ptr)
        return owner is not None and owner() is not None

    def kept_by_reason(self) -> dict[str, int]:
        """Bytes of kept storages (each once), by the reason they were kept."""
        out: dict[str, int] = {}
        for nbytes, why in self.kept_storages.values():
            out[why] = out.get(why, 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self) -> MemoryStats:
        kept = sum(nbytes for nbytes, _ in self.kept_storages.values())
        return MemoryStats(
            original_bytes=self.original_bytes,
            packed_bytes=self.packed_bytes + kept,
            kept_bytes=kept,
            tensors=self.compressed + self.kept,
            compressed=self.compressed,
            kept=self.kept,
            deduplicated=self.deduplicated,
            offloaded_bytes=self.offloaded_bytes,
            kept_by_reason=self.kept_by_reason(),
        )

    def table(self, sensitivity: dict | None = None) -> str:
        """One row a saved tensor; with ``sensitivity`` (by slot) a column of it."""
        head = ("key", "shape", "dtype", "op", "class", "bits", "before", "after")
        rows = [head + (("sensitivity",) if sensitivity else ())]
        for r in self.records:
            dtype = str(r.dtype).removeprefix("torch.")
            shape = "x".join(map(str, r.key.shape)) or "scalar"
            before, after = format_bytes(r.original_bytes), format_bytes(r.packed_bytes)
            bits = f"{r.label} {r.form}".lstrip() if r.form else r.label
            row = (str(r.key), shape, dtype, r.op, r.cls, bits, before, after)
            if sensitivity:
                c = sensitivity.get(r.key.slot)
                row += ("" if c is None else f"{c:.3g}",)
            rows.append(row)
        s = self.summary()
        total = ("total", f"{s.tensors} tensors", "", "", "", "")
        total += (format_bytes(s.original_bytes), format_bytes(s.packed_bytes))
        rows.append(total + (("",) if sensitivity else ()))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) if i < 6 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        lines.append(f"ratio {s.ratio:.2f}x; {s.deduplicated} saves deduplicated")
        if s.offloaded_bytes:
            lines.append(f"in pinned CPU memory: {format_bytes(s.offloaded_bytes)} of {format_bytes(s.packed_bytes)}")
        kept = ", ".join(f"{why} {format_bytes(n)}" for why, n in self.kept_by_reason().items())
        if kept:
            lines.append(f"kept as is (each storage once): {kept}")
        return "\n".join(lines)


def counted_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that saving ``t`` holds, as ``(start, end)``: the whole storage (a view of an
    op's result keeps all of it alive), except for a view of data that lives anyway (a leaf that does not
    require grad: a batch sliced from a dataset, ``X[:64]``), which holds the bytes it covers, from its first
    element to its last."""
    try:
        storage = t.untyped_storage().nbytes()
        base = t if t._base is None else t._base
        if t._base is None or base.grad_fn is not None or base.requires_grad:
            return 0, storage
        item = t.element_size()
        start = t.storage_offset() * item
        if t.numel() == 0:
            return start, start
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return start, min(start + (last + 1) * item, storage)
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (nested, functional wrappers)
        return 0, t.numel() * t.element_size()


def cover(ranges: list, start: int, end: int) -> int:
    """Add the byte range ``[start, end)`` to ``ranges`` (disjoint, kept so); return the bytes it adds."""
    if end <= start:
        return 0
    added, lo, hi, rest = end - start, start, end, []
    for a, b in ranges:
        if b <= start or a >= end:
            rest.append((a, b))
        else:
            added -= min(b, end) - max(a, start)
            lo, hi = min(lo, a), max(hi, b)
    rest.append((lo, hi))
    ranges[:] = rest
    return added


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
