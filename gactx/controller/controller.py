"""The Controller: routes every tensor autograd saves through compression and back.

``install_hook()`` enters ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` (public API only).
``pack`` returns a small :class:`Packed` handle that autograd keeps exactly as long as the graph needs it;
``unpack`` decodes it and may run any number of times (``retain_graph``, double backward): nothing is ever
freed by hand. Neither hook synchronizes the GPU: every decision uses shapes, dtypes and addresses only.
"""

from __future__ import annotations

import logging
import warnings
import weakref
import zlib
from collections.abc import Callable

import torch
from torch import nn

from gactx.config import Config, make_config
from gactx.controller.adaptation import Adaptation, default_width, plan, reduce_across_ranks
from gactx.controller.identity import Key, ModuleTracker
from gactx.controller.offload import HostCopy, Offloader
from gactx.controller.policy import KEEP_PARAMETER, keep_reason, storage_owner, storage_ptr
from gactx.controller.sensitivity import Probe, estimate_sensitivities
from gactx.controller.stats import KeyRecord, MemoryStats, PassStats
from gactx.kernels import QuantizedTensor, dequantize, quantize

__all__ = ["Controller", "Packed"]

logger = logging.getLogger(__name__)
_MASK62 = (1 << 62) - 1


class Packed:
    """What autograd holds instead of a saved activation: the compressed tensor (on its device, or its
    :class:`HostCopy` in pinned CPU memory) and its key."""

    __slots__ = ("qt", "key", "source", "backend", "__weakref__")

    def __init__(self, qt: QuantizedTensor | HostCopy, key: Key, source: torch.Tensor, backend: str) -> None:
        self.qt = qt
        self.key = key
        self.source = weakref.ref(storage_owner(source))  # dedupe is valid only while the storage lives
        self.backend = backend

    def unpack(self) -> torch.Tensor:
        qt = self.qt
        if isinstance(qt, HostCopy):
            qt = qt.offloader.fetch(qt)
        return dequantize(qt, backend=self.backend)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    """A tensor kept as it is, without its autograd history. Returning a node's own output from the pack hook
    would make the node hold its output and the output hold the node: a cycle through C++ that Python's
    garbage collector cannot see, so a graph never run backward (an evaluation with grad enabled, a step
    abandoned after an exception) would never be freed. Autograd re-attaches the history on unpack."""
    return t.detach() if t.grad_fn is not None else t


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
        level: ``"L0"`` (account, compress nothing), ``"L1"`` (4 bits), ``"L1.1"`` (8), ``"L1.2"`` (2),
            ``"L2"`` / ``"L2.1"`` / ``"L2.2"`` (adaptive, average 4 / 3 / 2 bits), ``"L3"`` (L2, with compressed
            CUDA tensors offloaded to pinned CPU memory and prefetched in backward); ``None`` takes the level
            set by :func:`gactx.set_optimization_level` (default ``"L1"``).
        **options: fields of :class:`gactx.Config` (``bits``, ``budget``, ``adapt_interval``, ``group_size``,
            ``min_numel``, ``stochastic``, ``dedupe``, ``backend``, ``seed``, ...); they win over the level.

    Use ``install_hook()`` / ``uninstall_hook()`` or ``with Controller(model) as controller:``, and call
    ``controller.iterate(backprop)`` once per training step, after ``optimizer.step()``. At the adaptive
    levels ``backprop`` is a closure that runs forward and backward on a (small) batch: after the first
    step and every ``adapt_interval`` steps the controller runs it ``1 + 2 L`` times (``L`` compressed
    tensors) to measure sensitivities, then allocates bits under the budget.
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
        self._probe: Probe | None = None
        self._slot_bits: dict[tuple, int] = {}  # the allocation, by slot (module, call, index)
        self.sensitivity: dict[tuple, float] = {}  # the last estimate, by slot
        self.last_adaptation: Adaptation | None = None
        self._warned_no_closure = False
        self._offloader = Offloader(self.config.prefetch) if self.config.offload else None
        self._warned_offload = False
        if self._offloader is not None and not torch.cuda.is_available():
            self._warn_offload("no CUDA device is available")

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
        # The hooks run eagerly: compression is data movement outside any graph. Marking them so keeps
        # torch.compile from trying to trace them (and breaking the graph on storage addresses).
        pack, unpack = torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
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

    def iterate(self, backprop: Callable[[], object] | None = None) -> None:
        """Call once per training step, after ``optimizer.step()``. ``backprop`` is a closure that runs
        forward and backward on a batch; the adaptive levels use it to measure sensitivities."""
        if backprop is not None and not callable(backprop):
            raise TypeError(f"backprop must be callable or None, got {type(backprop).__name__}")
        self.step += 1
        cfg = self.config
        if not cfg.adaptive or (self.step != 1 and self.step % cfg.adapt_interval != 0):
            return
        if backprop is None:
            if not self._warned_no_closure:
                warnings.warn(
                    f"gactx level {cfg.level} adapts bits only when iterate() gets a backprop closure; "
                    f"every tensor stays at {default_width(cfg.bits)} bits",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._warned_no_closure = True
            return
        self.adapt(backprop)

    def adapt(self, backprop: Callable[[], object]) -> Adaptation:
        """Measure every compressed tensor's sensitivity with ``backprop`` and allocate bits now.

        The model is left as it was: parameters untouched, buffers (BatchNorm statistics) and every
        ``.grad`` restored, RNG states (CPU and CUDA) restored. Returns what it cost and chose.
        """
        cfg = self.config
        if not cfg.adaptive:
            raise RuntimeError(
                f"level {cfg.level} has fixed bits; adapt() needs an adaptive level (L2, L2.1, L2.2, L3)"
            )
        if not self._pass.records:
            raise RuntimeError("adapt() needs one training forward pass under the controller first")
        training_pass, was_installed = self._pass, self.installed
        if not was_installed:
            self.install_hook()
        try:
            estimate = estimate_sensitivities(
                self.model, backprop, self._discover, self._set_probe, cfg.probe_bits, self._probe_seed
            )
        finally:
            if not was_installed:
                self.uninstall_hook()
            self._pass, self._fresh_pass = training_pass, True
        self.sensitivity = reduce_across_ranks(estimate.sensitivity)
        allocation, budget = plan(cfg, training_pass, self.sensitivity)
        self._slot_bits = dict(allocation.bits)
        self.last_adaptation = Adaptation(
            step=self.step,
            passes=estimate.passes,
            seconds=estimate.seconds,
            budget_bytes=budget,
            allocated_bytes=allocation.nbytes,
            predicted_variance=allocation.variance,
            feasible=allocation.feasible,
        )
        logger.info("gactx adaptation at step %d: %s", self.step, self.last_adaptation)
        return self.last_adaptation

    # -- checkpoints ----------------------------------------------------------------------------------------

    STATE_VERSION = 1

    def state_dict(self) -> dict:
        """What a resumed run needs to keep its allocation: the step, the sensitivities and the bits (by slot:
        module name, call, index), and the level they belong to. Plain Python values: ``torch.save`` or
        JSON both take it."""
        return {
            "version": self.STATE_VERSION,
            "level": self.config.level,
            "step": self.step,
            "sensitivity": [[*slot, c] for slot, c in self.sensitivity.items()],
            "bits": [[*slot, b] for slot, b in self._slot_bits.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. A state from another level is refused: its bits answer another
        budget."""
        if not isinstance(state, dict) or state.get("version") != self.STATE_VERSION:
            raise ValueError(f"not a gactx Controller state (version {self.STATE_VERSION}): {type(state).__name__}")
        if state["level"] != self.config.level:
            raise ValueError(f"state saved at level {state['level']!r} cannot load into level {self.config.level!r}")
        self.step = int(state["step"])
        self.sensitivity = {(m, int(c), int(i)): float(v) for m, c, i, v in state["sensitivity"]}
        self._slot_bits = {(m, int(c), int(i)): int(b) for m, c, i, b in state["bits"]}

    def bits_for(self, key: Key) -> int | None:
        """Bits given to the tensor named ``key`` (``None``: kept as it is)."""
        cfg = self.config
        if self._probe is not None and key[:3] == self._probe.slot:
            return self._probe.bits
        if not cfg.adaptive:
            return cfg.bits
        return self._slot_bits.get(key[:3], default_width(cfg.bits))

    # -- adaptation helpers -------------------------------------------------------------------------------

    def _discover(self, run: Callable[[], object]) -> list[tuple]:
        self._pass, self._fresh_pass = PassStats(), False
        run()
        return [r.key[:3] for r in self._pass.records if isinstance(r.bits, int) and r.dtype.is_floating_point]

    def _set_probe(self, probe: Probe | None) -> None:
        self._probe = probe

    def _probe_seed(self, slot: tuple, k: int) -> int:
        return _mix(self.config.seed, self.step, zlib.crc32(repr(slot).encode()), k)

    # -- accounting -------------------------------------------------------------------------------------------

    def memory_stats(self) -> MemoryStats:
        """Saved-activation bytes of the most recent forward pass that saved anything."""
        return self._pass.summary()

    def report(self) -> str:
        """A table of the most recent forward pass: one row a saved tensor (key, shape, dtype, bits, bytes;
        at the adaptive levels also its sensitivity), then the cost of the last adaptation."""
        lines = [f"gactx level {self.config.level}, step {self.step}", self._pass.table(self.sensitivity or None)]
        a = self.last_adaptation
        if a is not None:
            lines.append(
                f"last adaptation at step {a.step}: {a.passes} forward+backward passes, {a.seconds:.2f} s; "
                f"{a.allocated_bytes} of {a.budget_bytes} bytes allowed for compressed tensors"
                + ("" if a.feasible else " (budget not met: narrowest widths)")
            )
        return "\n".join(lines)

    # -- hooks ----------------------------------------------------------------------------------------------

    def _new_pass(self) -> None:
        # Cheap bookkeeping only: torch.compile traces module hooks, so the parameter addresses are read
        # again in the first pack of the pass (an eager hook), not here.
        self._fresh_pass = True

    def _warn_offload(self, why: str) -> None:
        if not self._warned_offload:
            warnings.warn(
                f"gactx offload (level L3, offload=True) moves compressed CUDA tensors only ({why}): "
                f"the others are compressed and stay on their device",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned_offload = True

    def _refresh_model_ptrs(self) -> None:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self._model_ptrs = frozenset(p for p in map(storage_ptr, tensors) if p is not None)

    def _begin_pass_if_fresh(self) -> PassStats:
        if self._fresh_pass:
            self._pass = PassStats()
            self._dedupe = weakref.WeakValueDictionary()
            self._refresh_model_ptrs()
            self._fresh_pass = False
            if self._offloader is not None:
                self._offloader.begin_pass()
        return self._pass

    def _pack(self, t: torch.Tensor):
        cfg = self.config
        stats = self._begin_pass_if_fresh()
        ptr = storage_ptr(t)
        reason = keep_reason(t, ptr, cfg.min_numel, self._model_ptrs)
        if reason == KEEP_PARAMETER:
            return _as_is(t)
        key = self._tracker.key(t)
        ptr = ptr or 0
        nbytes, storage_bytes = t.numel() * t.element_size(), self._storage_bytes(t)
        if cfg.dedupe and stats.holds(ptr):
            stats.deduplicated += 1  # its storage is already kept as is: another view of it is free
            return _as_is(t)
        bits = self.bits_for(key) if reason is None else None
        if bits is None or bits == 32 or (bits == 16 and t.dtype != torch.float32 and t.dtype != torch.bool):
            why = reason or ("L0" if bits is None else f"{bits} (as is)")
            stats.add(KeyRecord(key, t.dtype, why, nbytes, nbytes, storage_bytes), t, ptr, False)
            return _as_is(t)
        dedupe_key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        if cfg.dedupe:
            hit = self._dedupe.get(dedupe_key)
            if hit is not None and hit.source() is not None:
                stats.deduplicated += 1
                return hit
        probe = self._probe
        if probe is not None and key[:3] == probe.slot:
            seed = probe.seed
        else:
            seed = _mix(cfg.seed, self.step, self._key_ids.setdefault(key, len(self._key_ids)))
        qt = quantize(t, bits, cfg.group_size, stochastic=cfg.stochastic, seed=seed, backend=cfg.backend)
        record = KeyRecord(key, t.dtype, qt.bits, nbytes, qt.nbytes, storage_bytes)
        offloaded = False
        if self._offloader is not None:
            if self._offloader.accepts(qt.data):
                qt, offloaded = self._offloader.offload(qt), True
            else:
                self._warn_offload(f"a tensor on {t.device.type}")
        handle = Packed(qt, key, t, cfg.backend)
        if cfg.dedupe:
            self._dedupe[dedupe_key] = handle
        stats.add(record, t, ptr, True, offloaded)
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
