"""The pack path, one way: decide (policy, op rule, key, bits) -> compress -> handle, and one record.

For each tensor autograd saves, :meth:`PackPath.pack`:

1. keeps parameters and their views (no record: not activation memory); names the save (its key); replays the
   key's save of the last pass where it was kept for that (``replay.py``: steps 2 to 5 done again); and keeps what the
   policy keeps (integers, float64, small, other layouts; see ``policy.py``);
2. finds the save's :class:`~gactx.controller.rules.Site` (op, role, scalar arguments): from the op watcher
   in a pass it watches (the handle may wait one op for it), from what was learned for the slot before
   (``sites.py``), or from the ``grad_fn`` of a saved result; else the op is unknown;
3. decides (``decide.py``: a :class:`~gactx.controller.decide.Decision` of the site's
   :class:`~gactx.controller.rules.Rule`, and the plan's width, scheme and noise seed for the slot);
4. encodes (``store.encode``) unless the same tensor was already stored the same way in this pass;
5. records it once (``PassStats.record``: one :class:`~gactx.controller.stats.KeyRecord`, key, op, class, bits or
   reason, bytes) for the memory statistics, the report and the adaptation.

Followed through for one saved tensor, the path leaves this module for one other at a time: the policy (a
parameter?), the keys, the policy again (its value), the pass's statistics (is its storage kept already), the sites
(its op, as learned), the decision, the store, the record, the handle; a replayed save the policy, the keys and its
replay; while keys go by position (``identity.py``), a replayed save the policy, the save at its position and the
record (:meth:`PackPath._by_position`). It never calls up into the Controller (``tests/controller/test_pack.py``
follows one).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gactx.config import Config
from gactx.controller.checkpoint import SAVING
from gactx.controller.decide import BOOL_MASK, Decision, decide, may_share
from gactx.controller.identity import (
    BACKWARD,
    Key,
    ModuleTracker,
    Slot,
    graph_task_id,
    in_backward,
    passes_saves_on,
)
from gactx.controller.offload import Offloader
from gactx.controller.plan import MASK62, Plan
from gactx.controller.policy import ModelStorages, is_weight, keep_reason, storage_ptr
from gactx.controller.probes import Deferred, Waiting
from gactx.controller.product import PRODUCT, derivable, factors, remember, stores_values
from gactx.controller.replay import Replay, replayable
from gactx.controller.rules import (
    ALLOCATED,
    CHECKPOINT_INPUT,
    CONSTANT,
    UNKNOWN,
    Rule,
    Site,
    node_id,
    output_rule,
)
from gactx.controller.sites import Sites, rule_of
from gactx.controller.stats import AS_IS, EXACT, PassStats
from gactx.controller.store import Kept, Packed, as_is, encode, stored_form
from gactx.controller.watch import OpWatcher
from gactx.kernels import QuantizedTensor

__all__ = ["MAX_REPLAYS", "PackPath"]

logger = logging.getLogger(__name__)
MAX_REPLAYS = 16384  # saves kept to be replayed (one a key): a few passes of a large model
PRODUCTS = True  # store a save that is the product of two stored saves as that product (product.py)


class PackPath:
    """Packs the saved tensors of the passes of one model (see the module docstring).

    ``plan`` (``plan.py``, replaced by the controller, never changed) gives the width of an allocated class, the
    scheme the allocation chose for it (``None``: uniform codes; see ``adaptation/choices.py``), the noise seed, and
    whether the sensitivity estimator perturbs the slot now (then the tensor is quantized uniformly, whatever its
    class). ``decide.py`` reads it for each save."""

    def __init__(
        self,
        config: Config,
        tracker: ModuleTracker,
        model: torch.nn.Module,
        plan: Plan,
        offloader: Offloader | None,
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.model = model
        self._plan = plan
        self.replays: dict[Key, Replay] = {}  # key -> its save as last stored, done again while valid (replay.py)
        self.key_ids: dict[Key, int] = {}  # each key's number, first seen first: its noise seed's part
        self.offloader = offloader
        self.stats = PassStats()
        self.backward_stats = PassStats()  # saves made during backward (recomputation), since the last forward
        self.fresh = True  # a new pass began; its first save replaces self.stats
        # (storage, view, version, form) -> (a weak reference to the handle made for it this pass, one to the storage,
        # the decision it was stored under)
        self.dedupe: dict[tuple, tuple[weakref.ref, StorageWeakRef, Decision]] = {}
        self.sites = Sites()  # each slot's op as learned, and what later saves shared (sites.py)
        self.relearn = config.op_rules != "off"  # watch the next pass
        self.watcher = OpWatcher(self._resolve)
        self.watching = False
        self._eager = None
        self._measured: frozenset[Slot] | None = None  # a probe pass against the exact base: the slots it stores
        self._claimed: set[int] = set()  # nodes whose result save was seen (unwatched passes)
        self._ptrs: frozenset[int] | None = None  # the model's storages, read at the pass's first eager save
        self._model_storages = ModelStorages(model)
        # Called as observe(key, tensor, rule) for each tensor of an allocated class before it is stored (not for
        # a tensor shared through dedupe): what the estimators measure on the values themselves. Device work
        # only, never a host read (a hook must not synchronize).
        self.observers: list[Callable[[Key, torch.Tensor, Rule], None]] = []
        # Called as unpacked(target, forward) at each unpack of a deferred save (probes.py), while an estimate
        # watches which backward nodes read each slot (adaptation/replayed.py).
        self.unpacked: Callable[[Slot, bool], None] | None = None
        # The slots of the deferred saves of allocated classes that store their own tensor, while an estimate asks
        # (gact_estimator.REPLAY_FIRST: its first pass a replay, the training pass's saves checked against these)
        self.deferred: set[Slot] | None = None
        # Called before each eager save once compiled graphs log theirs (compiled.py): their records come first.
        self.before_save: Callable[[], None] | None = None
        # Saves stored as the product of two others (product.py): at fixed widths, nothing offloaded. The pass's number
        # (what factors are remembered under), the keys of saves that were factors of one (their replays remember) and
        # of saves that were one (never replayed: each pass checks its own graph).
        self.products = PRODUCTS and not config.adaptive and offloader is None
        self.serial = 0
        self.factor_keys: set[Key] = set()
        self.product_keys: set[Key] = set()

    @property
    def plan(self) -> Plan:
        return self._plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        """A new plan (the controller's): the replays made under the old one hold while only the step (its seeds)
        changed."""
        old, self._plan = self._plan, plan
        if (plan.allocation, plan.choices, plan.probe, plan.bits, plan.adaptive) != (
            old.allocation, old.choices, old.probe, old.bits, old.adaptive
        ) or plan.probe is not None:  # fmt: skip
            self.replays.clear()
        # Against the exact base only the probed slots, and the later saves that share what they store, are stored.
        self._measured = None
        if plan.exact and not plan.deferred:
            self._measured = frozenset(plan.probe).union(*(self.sites.sharers.get(s, ()) for s in plan.probe))

    # -- passes ---------------------------------------------------------------------------------------------

    def begin_forward(self, watch: bool = True) -> None:
        """The model's forward begins: a new pass, watched if something new was met in the last one (``watch``:
        whether it may be; not under another library's saved-tensor hooks, which may never show it a save)."""
        self.end_forward()  # a forward that never ended (interrupted): its watcher off first
        self.fresh = True
        cfg = self.config
        watch = watch and (cfg.op_rules == "always" or (cfg.op_rules == "learn" and self.relearn))
        if watch and cfg.bits is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self.relearn = False
            self.replays.clear()  # the ops learned in this pass may differ
            # Compiled regions inside the model run eagerly in a watched pass: torch.compile refuses to compile
            # under a dispatch mode, and then skips the code for good.
            self._eager = torch.compiler.set_stance("force_eager")
            self._eager.__enter__()
            self.watcher.__enter__()
            self.watching = True

    def end_forward(self) -> None:
        if self.watching:
            self.watching = False
            self.watcher.flush()
            self.watcher.__exit__(None, None, None)
            self._eager.__exit__(None, None, None)

    def begin_pass_if_fresh(self) -> PassStats:
        """The pass's statistics: new ones if a forward began since the last save (eager or compiled)."""
        if self.fresh:
            self.stats, self.backward_stats = PassStats(), PassStats()
            self.serial += 1
            self.dedupe = {}
            self._claimed = set()
            self._ptrs = None  # a pass of compiled graphs alone never needs them
            self.fresh = False
            if self.offloader is not None:
                self.offloader.begin_pass()
        return self.stats

    # -- the path -------------------------------------------------------------------------------------------

    @passes_saves_on
    def pack(self, t: torch.Tensor):
        if self.before_save is not None:
            self.before_save()
        if self.watching:
            with self.watcher.quiet():  # what the pack hook itself runs (a detach) is not the model's
                return self._pack(t)
        if not self.fresh and graph_task_id() == -1:  # most saves: a pass under way, no backward running
            if self.tracker.by_position and not self.observers:
                return self._by_position(t)
            return self._pack_in(t, self.stats)
        return self._pack(t)

    @passes_saves_on
    def _pack(self, t: torch.Tensor):
        if in_backward():
            # Saved while backward runs (a reentrant checkpoint recomputing its segment): compressed alike,
            # counted apart, no forward pass's.
            forward, self.stats = self.stats, self.backward_stats
            try:
                return self._pack_in(t, self.stats)
            finally:
                self.stats = forward
        return self._pack_in(t, self.begin_pass_if_fresh())

    @passes_saves_on
    def _pack_in(self, t: torch.Tensor, stats: PassStats):
        try:  # storage_ptr(t), inlined: every save
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            ptr = None
        ptrs = self._ptrs
        if ptrs is None:
            ptrs = self._ptrs = self._model_storages()
        if ptr is not None and is_weight(t, ptr, ptrs) and t.layout is torch.strided and not t.is_meta:
            # Kept with its history (policy.KEEP_PARAMETER): a parameter, a view of one or a cast copy of one (the node
            # that saves it is never the node that made it, so no node holds its own output; store.as_is)
            return Kept(t, t._version)
        return self._keyed(t, self.tracker.key(t), ptr, ptrs, stats)

    @passes_saves_on
    def _by_position(self, t: torch.Tensor):
        """A save of a pass whose keys go by position (``identity.py``), where the save at its position was replayed:
        :meth:`_pack_in` and :meth:`_replayed` in one, with what the tracker checked against the position (shape,
        dtype, node, call site) not checked again. Any other save goes their way."""
        stats, ptrs = self.stats, self._ptrs
        try:  # storage_ptr(t), inlined
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return self._pack_in(t, stats)
        if ptrs is None:
            return self._pack_in(t, stats)
        if is_weight(t, ptr, ptrs):
            return Kept(t, t._version) if t.layout is torch.strided and not t.is_meta else self._pack_in(t, stats)
        at = self.tracker.at_position(t)
        if at is None:
            return self._pack_in(t, stats)
        key, node, dtype = at[0], at[1], at[2]
        replay = self.replays.get(key)
        if (
            replay is None or replay.native is None or replay.shared
            or replay.node is not node or replay.dtype is not dtype or t.layout is not torch.strided
            or self._measured is not None or SAVING.inputs
        ):  # fmt: skip
            return self._keyed(t, key, ptr, ptrs, stats)
        seen = stats.live.get(ptr)
        if seen is not None and seen[0]() is not None:  # a storage an earlier save of the pass holds
            return self._keyed(t, key, ptr, ptrs, stats)
        handle = replay.native(t, (self._plan.seed_base + replay.weyl) & MASK62)
        if handle is None:  # not contiguous (stored in memory order), or on another device than the CPU's packer's
            return self._keyed(t, key, ptr, ptrs, stats)
        replay.record = stats.record_replayed(t, key, ptr, replay.record)
        if replay.claims:
            self._claimed.add(node_id(t.grad_fn))
        return handle

    def _keyed(self, t: torch.Tensor, key: Key, ptr: int | None, ptrs: frozenset[int], stats: PassStats):
        """:meth:`_pack_in` of a save that is no weight, named ``key``."""
        cfg = self.config
        if self._measured is not None and key.slot not in self._measured:
            # A probe pass against the exact base: a save it does not probe, as it is, by an alias of its own (the
            # tensor lives on only where something else holds it, as in training: store.Packed reads it there).
            return Kept(t.detach(), t._version)
        replay = self.replays.get(key)
        if (
            replay is not None and ptr is not None
            and t.dtype is replay.dtype and type(t.grad_fn) is replay.node and t.device == replay.device
            and t.layout is torch.strided
            and not (self.watching or SAVING.inputs)
        ):  # fmt: skip
            # Its policy is the replayed save's, which no reason kept: the same dtype, shape (the key's), device,
            # layout (strided: a layout the policy keeps is never replayed) and node. No save of the pass holds its
            # storage yet (most saves), or one holds it in another form (a ReLU's mask of a convolution's input) and
            # the whole path would neither share what a save of this view stored in this form nor find the storage
            # kept as is.
            seen = stats.live.get(ptr)
            if (
                seen is None or seen[0]() is None
                or not stats.holds(ptr) and _view(t, key, ptr, replay.form) not in self.dedupe
            ):  # fmt: skip
                return self._replayed(replay, t, key, ptr, stats)
        reason = keep_reason(t, ptr, cfg.min_numel, ptrs)
        slot, ptr = key.slot, ptr or 0
        if cfg.dedupe and stats.holds(ptr):
            stats.extend(t, ptr)  # its storage is already kept as is: another view of it costs no copy
            return Kept.of(t)
        if reason is not None or cfg.bits is None:
            stats.record(t, key, ptr, None, None, None, reason or "L0")
            return Kept.of(t)
        if SAVING.inputs:  # a checkpointed region's input: no op of the model saves it (checkpoint.py)
            return self._finish(t, key, slot, ptr, None, CHECKPOINT_INPUT)
        if self.watching:
            # Compressed at the next op's dispatch, where no mode is active: compressing here would send each
            # of the compression's own ops through the watcher. A result save knows its op already; an input
            # save learns it then.
            if self._plan.deferred and t.dtype != torch.bool:  # kept for each backward's probe, its op learned too
                deferred = Deferred(t, key, self.sites.target(slot), self, None, ptr, None)
                self.watcher.pending.append((Waiting(t, deferred), self.watcher.result_site(t)))
                return deferred
            handle = Packed(t, key, t, cfg.backend, ptr)
            self.watcher.pending.append((handle, self.watcher.result_site(t)))
            return handle
        if t.dtype == torch.bool:
            return self._finish(t, key, slot, ptr, None, BOOL_MASK)
        site, rule, learned = self._recall(t, key, slot)
        return self._finish(t, key, slot, ptr, site, rule, replay=learned)

    def _learn(self, t: torch.Tensor, slot: Slot, site, rule: Rule, learn) -> None:
        """What a save's op tells the path: its slot's site and rule where they were ``learn``-ed now, and a result's
        node claimed."""
        if learn is not None:
            self.sites.learn(t, slot, learn[0], learn[1], rule)
        if site is not None and site.result and t.grad_fn is not None:
            self._claimed.add(node_id(t.grad_fn))  # later saves of this tensor are other ops' inputs

    def _replayed(self, replay: Replay, t: torch.Tensor, key: Key, ptr: int, stats: PassStats) -> Packed:
        """The save of ``key`` done again (``replay.py``), and what the whole path does after storing it: a result's
        node claimed, the handle registered for later saves of the same tensor."""
        if self.observers and replay.observed:  # as _store calls them, before the encoding
            for observe in self.observers:
                observe(key, t, replay.decision.rule)
        handle = replay.pack(t, key, ptr, stats, self._plan)
        if replay.claims:
            self._claimed.add(node_id(t.grad_fn))
        if replay.factor:
            remember(t, handle, self.serial, key)
        if replay.shared and self.config.dedupe:
            self.dedupe[_view(t, key, ptr, replay.form)] = _entry(handle, t, replay.decision)
        return handle

    def _recall(self, t: torch.Tensor, key: Key, slot: Slot) -> tuple[Site | None, Rule, bool]:
        """The site and rule of a save in an unwatched pass, and whether they were learned for its slot: else read
        from a result's ``grad_fn``, or unknown (and then the next pass inside the model's forward is watched)."""
        recalled = self.sites.recall(t, key, slot)
        if recalled is not None:
            return recalled
        if self.tracker.inside and self.config.op_rules == "learn":
            self.relearn = True
        found = output_rule(t, self._claimed)
        if found is not None:
            return *found, False
        if not self.tracker.inside and t.grad_fn is None and not t.requires_grad and not in_backward():
            # Outside the forward, unwatched: it may be a float dropout mask. Not a recomputation's save in backward
            # (a checkpointed region's, whose tensors have no history there): those are the region's own ops'.
            return None, CONSTANT, False
        return None, UNKNOWN, False

    def _resolve(self, handle: Packed, site: Site, origin: str | None) -> None:
        """A pending handle's op is known (called from the watcher, outside any dispatch mode)."""
        if isinstance(handle, Waiting):  # a deferred save: its op learned, nothing stored
            deferred, key = handle.deferred, handle.deferred.packed.key
            rule = rule_of(site, origin)
            self._learn(handle.stored, key.slot, site, rule, (site, origin))
            deferred.site = site
            if deferred.target != key.slot:  # a later save of what another slot stores (Deferred.rule)
                deferred.rule = rule
            elif rule.cls in ALLOCATED:  # as _finish tells a deferred save
                self._deferred_own(key, handle.stored, rule)
            return
        t = handle.stored
        ptr = storage_ptr(t) or 0
        if self.config.dedupe and self.stats.holds(ptr):
            # Kept as is by a save resolved just before (a log_softmax result that nll_loss saves as its input):
            # what an unwatched pass finds at the save itself, where that one is already recorded.
            self.stats.extend(t, ptr)
            handle.stored = as_is(t)
            return
        if t.dtype == torch.bool:
            self._finish(t, handle.key, handle.key.slot, ptr, None, BOOL_MASK, handle=handle)
        else:
            key = handle.key
            self._finish(t, key, key.slot, ptr, site, rule_of(site, origin), handle=handle, learn=(site, origin))

    def _finish(
        self, t, key: Key, slot: Slot, ptr: int, site, rule: Rule, handle: Packed | None = None, learn=None,
        replay: bool = False,
    ):  # fmt: skip
        """Decide (``decide.py``), store ``t`` (or share what the same tensor stored the same way got), record it,
        and return the handle (a new one, or ``handle`` filled in) or the tensor itself when it is kept. ``replay``:
        the rule was learned for the slot in an unwatched pass, and the save may be kept for the next pass to replay
        (``replay.py``)."""
        cfg = self.config
        if learn is not None or site is not None and site.result:  # most saves: an input's, its op recalled
            self._learn(t, slot, site, rule, learn)
        if self._plan.deferred and rule.cls in ALLOCATED and handle is None:  # kept for each backward's probe
            target = self.sites.target(slot)
            if target == slot:  # its own save, not a later one of what another stores: what a first pass records
                self._deferred_own(key, t, rule)
            return Deferred(t, key, target, self, site, ptr, rule)
        number = self.key_ids.setdefault(key, len(self.key_ids))
        decision = decide(t, rule, self._plan, slot, cfg, number)
        # Same storage, view, version and form (LINEAR and ATTENTION share quantized codes); not the width. A tensor
        # that several ops save (the input of the Q, K and V projections) is one tensor to the allocator, under
        # the slot of its first save: the later saves share whatever that one stored (its width, its scheme, a
        # probe's noise), so what the estimator measures and what the budget counts is what training stores.
        shape = _view(t, key, ptr, decision.rule.form)
        entry = self.dedupe.get(shape) if cfg.dedupe else None
        # The address names the same storage only while that lives: asked of the storage itself, not of a Python
        # tensor that holds it (a base's wrapper can be freed, and made afresh, while its storage lives on).
        hit = None if entry is None or entry[1].expired() else entry[0]()
        if hit is not None and may_share(entry[2], decision, site):
            self.stats.deduplicated += 1
            self.sites.share(hit.key.slot, slot, site)
            first = self.replays.get(hit.key)
            if first is not None:
                first.shared = True  # its replays register their handles for this save to find
            if handle is None:
                handle = hit
            else:
                handle.stored = hit.stored
            if self.products and stores_values(entry[2]):
                remember(t, handle, self.serial, hit.key)
            return handle
        derived = self._product(t, key, ptr, site, decision)
        stored = derived if derived is not None else self._store(t, key, slot, ptr, site, decision)
        if (
            replay and hit is None and derived is None and not isinstance(stored, torch.Tensor)
            and self._may_replay(decision, key) and key not in self.product_keys
        ):  # fmt: skip
            if len(self.replays) >= MAX_REPLAYS:  # shapes that keep changing (sequence lengths): the newest kept
                self.replays.clear()
            self.replays[key] = kept = Replay(t, site, decision, number, cfg, self.stats.records[-1], stored)
            if key in self.factor_keys:
                kept.mark_factor()
        if handle is None and isinstance(stored, torch.Tensor):
            handle = Kept(stored, t._version)
        else:
            if handle is None:
                handle = Packed(stored, key, t, cfg.backend, ptr)
            else:
                handle.stored = stored
            if cfg.dedupe and hit is None:
                self.dedupe[shape] = _entry(handle, t, decision)
        if self.products and stores_values(decision):
            remember(t, handle, self.serial, key)
        return handle

    def _product(self, t: torch.Tensor, key: Key, ptr: int, site, decision: Decision):
        """What stores ``t`` as the product of two saves this pass stored (``product.py``), recorded; ``None`` where
        it is none, or is not to be stored so (not quantized as a linear input, a recomputation in backward)."""
        if not self.products or key.module == BACKWARD or not derivable(decision):
            return None
        found = factors(t, self.serial)
        if found is None:
            return None
        product, keys = found
        if len(self.factor_keys) >= MAX_REPLAYS:  # shapes that keep changing: the newest kept, as the replays are
            self.factor_keys.clear()
            self.product_keys.clear()
        self.product_keys.add(key)
        for k in keys:  # their replays remember what they store, for the next pass to find
            self.factor_keys.add(k)
            first = self.replays.get(k)
            if first is not None:
                first.mark_factor()
        self.stats.record(t, key, ptr, site, decision.rule, None, "", product, False, PRODUCT)
        return product

    def _deferred_own(self, key: Key, t: torch.Tensor, rule: Rule) -> None:
        """A deferred save of an allocated class that stores its own tensor: told to :attr:`deferred` where set and made
        by the forward (not by a recomputation inside backward, which a training pass does not record either), and
        measured by the observers as :meth:`_store` measures a save (an estimate whose first pass is a replay,
        ``gact_estimator.REPLAY_FIRST``)."""
        if self.deferred is not None and not in_backward():
            self.deferred.add(key.slot)
        for observe in self.observers:
            observe(key, t, rule)

    def _may_replay(self, decision: Decision, key: Key) -> bool:
        """Whether a save of ``key`` just stored under ``decision`` may be replayed in later passes (``replay.py``):
        a forward pass's, nothing offloaded, a rule that stores it alone."""
        return (
            self.offloader is None and not self.watching and key.module != BACKWARD and replayable(decision, self._plan)
        )

    def _store(self, t, key: Key, slot: Slot, ptr: int, site, decision: Decision):
        """Encode, offload where asked, and record: what the handle will hold."""
        cfg = self.config
        rule, bits, choice = decision.rule, decision.bits, decision.choice
        if self.observers and rule.cls in ALLOCATED:
            for observe in self.observers:
                observe(key, t, rule)
        if decision.reason:
            if decision.reason is EXACT:  # a probe's exact save: not what training stores, and an alias of its own
                return t.detach()
            self.stats.record(t, key, ptr, site, rule, bits, decision.reason)
            return as_is(t)
        stored = encode(t, rule, bits, decision.seed, cfg.group_size, cfg.stochastic, cfg.backend, choice, site)
        if isinstance(stored, torch.Tensor):  # a mask the dtype cannot make exactly, a FewBit class at 16 or 32 bits
            self.stats.record(t, key, ptr, site, rule, bits, "kept" if rule.kind == "mask" else AS_IS)
            return stored
        encoded, offloaded = stored, False
        if self.offloader is not None and isinstance(stored, QuantizedTensor):
            if self.offloader.accepts(stored.data):
                stored, offloaded = self.offloader.offload(stored), True
            else:
                self.offloader.warn(f"a tensor on {t.device.type}")
        form = "" if choice is None else stored_form(encoded, choice)
        bits = bits if bits is not None else encoded.bits
        self.stats.record(t, key, ptr, site, rule, bits, "", encoded, offloaded, form)
        return stored


def _view(t: torch.Tensor, key: Key, ptr: int, form: str) -> tuple:
    """What the dedupe table knows a save by: its storage, view, version and stored form (not its width)."""
    return (ptr, t.storage_offset(), key.shape, t.stride(), t.dtype, t._version, form)


def _entry(handle: Packed, t: torch.Tensor, decision: Decision) -> tuple[weakref.ref, StorageWeakRef, Decision]:
    """The dedupe table's entry of a stored save: its handle, its storage (weakly) and its decision."""
    return weakref.ref(handle), StorageWeakRef(t.untyped_storage()), decision
