"""The Controller: routes every tensor autograd saves through compression and back.

``install_hook()`` enters ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` (public API only).
``pack`` returns a small :class:`Packed` handle that autograd keeps exactly as long as the graph needs it;
``unpack`` decodes it and may run any number of times (``retain_graph``, double backward): nothing is ever
freed by hand. Neither hook synchronizes the GPU: every decision uses shapes, dtypes and addresses only.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from gactx.config import Config, make_config
from gactx.controller.identity import Key, ModuleTracker
from gactx.controller.policy import KEEP_PARAMETER, keep_reason, storage_owner, storage_ptr
from gactx.controller.stats import KeyRecord, MemoryStats, PassStats
from gactx.kernels import QuantizedTensor, dequantize, quantize

__all__ = ["Controller", "Packed"]

logger = logging.getLogger(__name__)
_MASK62 = (1 << 62) - 1


class Packed:
    """What autograd holds instead of a saved activation: the compressed tensor and its key."""

    __slots__ = ("qt", "key", "source", "backend", "__weakref__")

    def __init__(self, qt: QuantizedTensor, key: Key, source: torch.Tensor, backend: str) -> None:
        self.qt = qt
        self.key = key
        self.source = weakref.ref(storage_owner(source))  # dedupe is valid only while the storage lives
        self.backend = backend

    def unpack(self) -> torch.Tensor:
        return dequantize(self.qt, backend=self.backend)


def _mix(*values: int) -> int:
    """A stable 62-bit hash of integers (splitmix64 steps): the noise seed of one tensor in one step."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK62


class Controller:
    """Compresses every activation that autograd saves for ``model``'s backward pass.

    Args:
        model: the ``nn.Module`` being trained; its modules name the saved tensors.
        level: ``"L0"`` (account, compress nothing), ``"L1"`` (4 bits), ``"L1.1"`` (8), ``"L1.2"`` (2);
            ``None`` takes the level set by :func:`gactx.set_optimization_level` (default ``"L1"``).
        **options: fields of :class:`gactx.Config` (``bits``, ``group_size``, ``min_numel``, ``stochastic``,
            ``dedupe``, ``backend``, ``seed``); they win over the level's values.

    Use ``install_hook()`` / ``uninstall_hook()`` or ``with Controller(model) as controller:``, and call
    ``controller.iterate(backprop)`` once per training step, after ``optimizer.step()``.
    """

    def __init__(self, model: nn.Module, level: str | None = None, **options) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Controller expects a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config: Config = make_config(level, **options)
        self.step = 0
        self._tracker = ModuleTracker(model, on_new_pass=self._new_pass)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._pass = PassStats()  # the most recent forward pass that saved anything
        self._fresh_pass = True  # a new pass began; its first save replaces self._pass
        self._dedupe: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._key_ids: dict[Key, int] = {}
        self._model_ptrs: frozenset[int] = frozenset()

    # -- installation -------------------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        return self._hooks is not None

    def install_hook(self) -> Controller:
        """Start compressing saved tensors (in this thread). Raises if already installed."""
        if self.installed:
            raise RuntimeError("this Controller's hooks are already installed; call uninstall_hook() first")
        self._tracker.attach()
        self._refresh_model_ptrs()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def uninstall_hook(self) -> None:
        """Stop compressing. Graphs built while installed stay valid: their handles decode on their own."""
        if not self.installed:
            raise RuntimeError("this Controller's hooks are not installed")
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        self._tracker.detach()

    def __enter__(self) -> Controller:
        return self.install_hook()

    def __exit__(self, *exc) -> None:
        if self.installed:
            self.uninstall_hook()

    # -- the training loop ----------------------------------------------------------------------------------

    def iterate(self, backprop=None) -> None:
        """Call once per training step, after ``optimizer.step()``. ``backprop`` is a closure that runs
        forward and backward on a batch; the adaptive levels use it to measure sensitivities."""
        if backprop is not None and not callable(backprop):
            raise TypeError(f"backprop must be callable or None, got {type(backprop).__name__}")
        self.step += 1

    def bits_for(self, key: Key) -> int | None:
        """Bits given to the tensor named ``key`` (``None``: kept as it is)."""
        return self.config.bits

    # -- accounting -------------------------------------------------------------------------------------------

    def memory_stats(self) -> MemoryStats:
        """Saved-activation bytes of the most recent forward pass that saved anything."""
        return self._pass.summary()

    def report(self) -> str:
        """A table of the most recent forward pass: one row a saved tensor (key, shape, dtype, bits, bytes)."""
        return f"gactx level {self.config.level}, step {self.step}\n{self._pass.table()}"

    # -- hooks ----------------------------------------------------------------------------------------------

    def _new_pass(self) -> None:
        self._fresh_pass = True
        self._dedupe = weakref.WeakValueDictionary()
        self._refresh_model_ptrs()

    def _refresh_model_ptrs(self) -> None:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self._model_ptrs = frozenset(p for p in map(storage_ptr, tensors) if p is not None)

    def _begin_pass_if_fresh(self) -> PassStats:
        if self._fresh_pass:
            self._pass = PassStats()
            self._fresh_pass = False
        return self._pass

    def _pack(self, t: torch.Tensor):
        cfg = self.config
        reason = keep_reason(t, cfg.min_numel, self._model_ptrs)
        if reason == KEEP_PARAMETER:
            return t
        stats = self._begin_pass_if_fresh()
        key = self._tracker.key(t)
        ptr = storage_ptr(t)
        nbytes = t.numel() * t.element_size()
        bits = self.bits_for(key) if reason is None else None
        if bits is None or bits == 32 or (bits == 16 and t.dtype != torch.float32 and t.dtype != torch.bool):
            why = reason or ("L0" if bits is None else f"{bits} (as is)")
            stats.add(KeyRecord(key, t.dtype, why, nbytes, nbytes), t, ptr or 0, self._storage_bytes(t), False)
            return t
        dedupe_key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        if cfg.dedupe:
            hit = self._dedupe.get(dedupe_key)
            if hit is not None and hit.source() is not None:
                stats.deduplicated += 1
                return hit
        seed = _mix(cfg.seed, self.step, self._key_ids.setdefault(key, len(self._key_ids)))
        qt = quantize(t, bits, cfg.group_size, stochastic=cfg.stochastic, seed=seed, backend=cfg.backend)
        handle = Packed(qt, key, t, cfg.backend)
        if cfg.dedupe:
            self._dedupe[dedupe_key] = handle
        stats.add(KeyRecord(key, t.dtype, qt.bits, nbytes, qt.nbytes), t, ptr or 0, self._storage_bytes(t), True)
        return handle

    @staticmethod
    def _unpack(packed):
        return packed.unpack() if isinstance(packed, Packed) else packed

    @staticmethod
    def _storage_bytes(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return t.numel() * t.element_size()
