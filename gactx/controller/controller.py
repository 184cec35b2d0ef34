"""The Controller: routes every tensor autograd saves through compression and back.

``install_hook()`` enters ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` (public API only).
``pack`` returns a small :class:`Packed` handle that autograd keeps exactly as long as the graph needs it;
``unpack`` decodes it and may run any number of times (``retain_graph``, double backward): nothing is ever
freed by hand. Neither hook synchronizes the GPU: every decision uses shapes, dtypes and addresses only.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from gactx.config import Config, _caller_level, make_config
from gactx.controller import checkpoint
from gactx.controller.adaptation import Adaptation, allocate_estimate, cost
from gactx.controller.adaptation.choices import Choice
from gactx.controller.adaptation.estimators import Estimator, ProgressLog, make_estimator
from gactx.controller.adaptation.schedule import Schedule, stable
from gactx.controller.compiled import INLINE, CompiledPath, HookGraph
from gactx.controller.identity import ModuleTracker, Slot
from gactx.controller.lane import graph_hooks
from gactx.controller.offload import Offloader
from gactx.controller.pack import PackPath
from gactx.controller.plan import Plan
from gactx.controller.rules import Site
from gactx.controller.state import STATE_VERSION, read_state, write_state
from gactx.controller.stats import KeyRecord, MemoryStats, PassStats, format_bytes
from gactx.controller.store import Packed
from gactx.kernels import native

__all__ = ["Controller", "Packed"]


def _top_hooks() -> tuple | None:
    """The saved-tensor hooks acting in this thread (the last installed), or ``None`` where this torch cannot
    say (then removal order is not checked)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False) or (None, None)


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
    step and every ``adapt_interval`` steps the controller runs it about ``2 + L`` times (``L`` compressed
    tensors; all but two a replay of its backward) to measure sensitivities, then allocates bits under the
    budget. With ``estimator="actnn"`` the sensitivities are read during the training step before each adaptation
    instead (no closure needed).
    """

    def __init__(self, model: nn.Module, level: str | None = None, *, config: Config | None = None, **options) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Controller expects a torch.nn.Module, got {type(model).__name__}")
        if config is not None:
            if not isinstance(config, Config):
                raise TypeError(f"config must be a gactx.Config, got {type(config).__name__}")
            if level is not None or options:
                raise TypeError("give either config= or a level and options, not both")
        self.model = model
        self.config: Config = config if config is not None else make_config(level, **options)
        self._tracker = ModuleTracker(model, on_new_pass=self._new_pass, on_pass_end=self._pass_end)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.sensitivity: dict[Slot, float] = {}  # the last estimate, by slot
        self.last_adaptation: Adaptation | None = None
        self._clock = cost.StepClock()  # training steps' wall time: what an adaptation's share is read against
        self._schedule = Schedule(self.config.adapt_interval, self.config.adapt_backoff)  # when adaptations run
        self._offloader = Offloader(self.config.prefetch) if self.config.offload else None
        self._path = PackPath(
            self.config,
            self._tracker,
            model,
            Plan.initial(self.config.bits, self.config.adaptive, self.config.seed),
            self._offloader,
        )
        self.estimator: Estimator = make_estimator(self.config, model, self._path, self._tracker)
        self._compiled = CompiledPath(self.config, self._tracker, self._path)
        self._graph_hooks: tuple[HookGraph, HookGraph] | None = None
        self._discovered: PassStats | None = None  # the eager pass an adaptation allocated for
        if self._offloader is not None and not torch.cuda.is_available():
            self._offloader.warn("no CUDA device is available")

    # -- installation -------------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """What the hooks store each save by (``plan.py``): the allocation's bits and schemes by slot, the probe,
        the step's seeds. Immutable: the controller replaces it as training goes on."""
        return self._path.plan

    @property
    def step(self) -> int:
        """Training steps ended by :meth:`iterate` (or restored by :meth:`load_state_dict`)."""
        return self._path.plan.step

    @step.setter
    def step(self, step: int) -> None:
        self._path.plan = self._path.plan.at_step(step, self.config.seed)

    @property
    def installed(self) -> bool:
        return self._hooks is not None

    def install_hook(self) -> Controller:
        """Start compressing saved tensors (in this thread: saved-tensor hooks are per thread). Raises if
        already installed. Hooks nest: of several installed in one thread (other controllers, PyTorch's
        ``saved_tensors_hooks`` or ``save_on_cpu``), the last installed acts and is the first to remove."""
        if self.installed:
            raise RuntimeError("this Controller's hooks are already installed; call uninstall_hook() first")
        self._thread = threading.get_ident()
        self._clock.start()
        self._tracker.attach()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*self.hooks)
        self._hooks.__enter__()
        checkpoint.install()  # non-reentrant checkpoints: inputs and recomputed tensors compressed (checkpoint.py)
        # Graphs compiled while installed pass their saved inputs to the hooks too (by default AOTAutograd
        # passes only the intermediates it owns): a compiled block's input is the activation the block
        # before it made. Parameters and buffers still do not reach them.
        self._filtering = torch._functorch.config.patch(saved_tensors_hooks_filtering_mode="no_static")
        self._filtering.__enter__()
        if not INLINE:
            _warn_no_compiled_path()
        return self

    def _make_graph_hooks(self) -> tuple[HookGraph, HookGraph]:
        """The hooks: GraphModules that AOTAutograd inlines into the graphs it compiles (``compiled.py``) and
        that run the eager path when called eagerly. torch.compile guards on the hooks' identity, so new
        hooks (after an allocation changed) recompile the graphs made with the old ones, and only then."""
        return graph_hooks(self._path, self._compiled, self.model)

    def uninstall_hook(self) -> None:
        """Stop compressing. Graphs built while installed stay valid: their handles decode on their own."""
        if not self.installed:
            raise RuntimeError("this Controller's hooks are not installed")
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "this Controller was installed in another thread; saved-tensor hooks belong to the thread that "
                "installed them: call uninstall_hook() there"
            )
        top = _top_hooks()
        if top is not None and top[0] is not self._graph_hooks[0]:
            raise RuntimeError(
                "saved-tensor hooks installed after this Controller's are still installed (another Controller, "
                "torch.autograd.graph.saved_tensors_hooks or save_on_cpu): hooks nest, so remove those first"
            )
        hooks, self._hooks = self._hooks, None
        self._filtering.__exit__(None, None, None)
        hooks.__exit__(None, None, None)
        checkpoint.uninstall()
        self._path.end_forward()  # uninstalled inside a forward: stop watching its ops
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
        self._clock.tick()
        self._compiled.drain()  # what compiled graphs logged this step: read once a step, it does not pile up
        cfg = self.config
        if not cfg.adaptive or not (self._schedule.due(self.step) or self.estimator.pending):
            return
        if self.estimator.ready(backprop):
            self.adapt(backprop)

    def adapt(self, backprop: Callable[[], object] | None = None) -> Adaptation:
        """Measure every compressed tensor's sensitivity with ``backprop`` and allocate bits now.

        The model is left as it was: parameters untouched, buffers (BatchNorm statistics) and every
        ``.grad`` restored, RNG states (CPU and CUDA) restored. Returns what it cost and chose (where GACT's estimator
        estimates twice, its passes and seconds are both rounds': ``sensitivity.EXACT_BASE``). With
        ``estimator="actnn"``: the estimate collected in the last step if there is one (no pass), else one
        ordinary pass of ``backprop`` read the same way.
        """
        cfg = self.config
        if not cfg.adaptive:
            raise RuntimeError(
                f"level {cfg.level} has fixed bits; adapt() needs an adaptive level (L2, L2.1, L2.2, L3)"
            )
        if not self._pass.records:
            raise RuntimeError("adapt() needs one training forward pass under the controller first")
        plan = self.plan
        before = {slot: plan.choices.get(slot, Choice(bits)) for slot, bits in plan.allocation.items()}
        progress, estimates = ProgressLog(self.step, self.estimator.rounds(bool(before))), []
        while len(estimates) < progress.rounds:  # an estimate may find that one more is needed (its rounds)
            progress.round = len(estimates) + 1
            estimates.append(self._adapt_once(backprop, progress, before))
            progress.rounds = self.estimator.rounds(bool(before))
        self._schedule.adapted(self.step, estimates[-1].stable)
        seconds, step_seconds = sum(e.seconds for e in estimates), self._clock.seconds
        interval = self._schedule.interval  # the steps this adaptation's cost is spread over
        self.last_adaptation = a = dataclasses.replace(
            estimates[-1], passes=sum(e.passes for e in estimates), seconds=seconds, step_seconds=step_seconds,
            share=cost.share(seconds, step_seconds, interval), interval=interval,
            passes_by_part=cost.summed([e.passes_by_part for e in estimates]),
            partial_passes=sum(e.partial_passes for e in estimates),
        )  # fmt: skip
        self._clock.resume()
        cost.announce(a, interval, self._clock.first_only)  # logged; a warning where it took long
        return a

    def _adapt_once(self, backprop: Callable[[], object] | None, progress: ProgressLog, before: dict) -> Adaptation:
        """One estimate and one allocation (:meth:`adapt`); ``before``: the allocation the adaptation began with. Its
        seconds are this call's wall time (the estimate, the allocation and the new plan), and what the estimate's own
        seconds hold beyond its call (the free estimator's: its hooks in the step before)."""
        start = time.perf_counter()
        cfg = self.config
        training_pass, was_installed = self._pass, self.installed
        if not was_installed:
            self.install_hook()
        try:
            # Compiled regions run eagerly here: each probe changes one tensor's width, which a compiled graph
            # would have to be recompiled for.
            # Every module followed: the closure's passes are no training passes to repeat by position (identity.py).
            with torch.compiler.set_stance("force_eager"), self._tracker.following():
                began = time.perf_counter()
                estimate = self.estimator.estimate(backprop, self.step, progress)
                before_call = max(estimate.seconds - (time.perf_counter() - began), 0.0)
        finally:
            if not was_installed:
                self.uninstall_hook()
            discovered, self._pass, self._path.fresh = self._pass, training_pass, True
        if self.estimator.discovered is not None:  # the estimator's first pass, where it ran one of its own
            discovered = self.estimator.discovered
        # A training pass of compiled graphs names its saves by graph; the allocation is by eager slot, and
        # compiled saves take widths from it by module, shape and dtype (plan.compiled_width).
        eager = training_pass if not training_pass.graph_runs else discovered
        self.sensitivity, allocation, budget = allocate_estimate(cfg, estimate, eager, discovered, before)
        choices = {k: c for k, c in (allocation.choices or {}).items() if c.scheme != "uniform"}
        old = self.plan
        if (allocation.bits != old.allocation or choices != old.choices) and self._compiled.saves:
            self._renew_graph_hooks()
        self._discovered = eager
        self._allocate(allocation.bits, choices)
        self.estimator.allocated_variance = allocation.variance
        self.last_adaptation = Adaptation(
            step=self.step,
            passes=estimate.passes,
            seconds=time.perf_counter() - start + before_call,
            budget_bytes=budget,
            allocated_bytes=allocation.nbytes,
            predicted_variance=allocation.variance,
            feasible=allocation.feasible,
            stable=stable(allocation.variance, allocation.kept_variance),
            passes_by_part=estimate.parts,
            partial_passes=estimate.partial,
        )
        return self.last_adaptation

    # -- checkpoints ----------------------------------------------------------------------------------------

    STATE_VERSION = STATE_VERSION

    def state_dict(self) -> dict:
        """What a resumed run needs to keep its allocation: the step, the sensitivities and the bits (by slot:
        module name, call, index), and the level they belong to. Plain Python values: ``torch.save`` or
        JSON both take it."""
        return write_state(
            self.config.level,
            self.step,
            self.sensitivity,
            dict(self.plan.allocation),
            dict(self.plan.choices),
            self._schedule.state(),
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. A state from another level is refused: its bits answer another
        budget."""
        step, self.sensitivity, bits, choices, schedule = read_state(state, self.config.level)
        self.step = step
        self._schedule.load(schedule)
        self._allocate(bits, choices)

    def _allocate(self, bits: dict[tuple, int], choices: dict[tuple, Choice]) -> None:
        """A new plan with this allocation; compiled graphs' widths from the eager pass it was made for."""
        compiled = None
        if self._discovered is not None:
            compiled = tuple(
                (r.key.module, r.key.shape, r.dtype, choices[s].fallback_bits if s in choices else bits[s])
                for r in self._discovered.records
                if (s := r.key.slot) in bits
            )
        self._path.plan = self._path.plan.allocated(bits, choices, compiled)

    def _renew_graph_hooks(self) -> None:
        """New hooks, so that compiled graphs are traced again with the new allocation."""
        installed = self.installed
        if installed:
            self.uninstall_hook()
        self._graph_hooks = None
        if installed:
            self.install_hook()

    @property
    def records(self) -> list[KeyRecord]:
        """One record a saved tensor of the most recent forward pass that saved anything, in save order: its
        key, dtype, bits (or why it was kept), bytes before and after, op and class (a copy: it does not
        change as training goes on)."""
        return [dataclasses.replace(r) for r in self._pass.records]

    @property
    def allocation(self) -> dict[Slot, int]:
        """The adaptive levels' bits by slot ``(module, call, index)`` (a copy; empty before the first
        adaptation and at fixed levels, where every compressed tensor gets ``config.bits``)."""
        return dict(self.plan.allocation)

    # -- inspection ---------------------------------------------------------------------------------------

    @property
    def hooks(self) -> tuple[HookGraph, HookGraph]:
        """The pack and unpack hooks the controller installs, to compose with other saved-tensor hooks: callables
        (``torch.fx.GraphModule``s that AOTAutograd inlines into compiled graphs). Made on first use; new ones once an
        adaptation changes the allocation, so that compiled graphs are traced again."""
        if self._graph_hooks is None:
            self._graph_hooks = self._make_graph_hooks()
        return self._graph_hooks

    @property
    def sites(self) -> dict[Slot, Site]:
        """The op each slot's save was learned as (by the op watcher in a watched pass, or from a saved result's
        ``grad_fn``): its aten op, argument or result, scalar arguments (a copy)."""
        return {slot: learned[0] for slot, learned in self._path.sites.learned.items()}

    def shared_with(self, slot: Slot) -> frozenset[Slot]:
        """The slots of later saves in the last pass that shared what the save of ``slot`` stored: the same tensor
        saved again, by another op (the input of the Q, K and V projections), under the first save's width."""
        return frozenset(self._path.sites.sharers.get(slot, ()))

    def sketchable(self, slot: Slot) -> bool:
        """Whether the save of ``slot`` may be stored as a row sketch: the input of a linear layer, as its op was
        learned, and so is every later save that shares what it stores (the other projections of one input)."""
        return self._path.sites.sketchable(slot)

    def weight_only(self, slot: Slot) -> bool:
        """Whether backward reads the save of ``slot`` only for weights' gradients (the input of a linear layer or a
        convolution, and every later save that shares what it stores): GACT's estimator probes such saves together
        where each is made in a module that owns its one weight."""
        return self._path.sites.weight_only(slot)

    def diagnostics(self) -> dict[str, int | bool]:
        """The sizes of the controller's own tables and the state of its op watcher, to check that nothing grows in a
        long run: ``keys`` (noise seeds' numbers, one a key ever seen), ``sites`` (learned ops, one a slot),
        ``handles`` and ``storages`` (this pass's dedupe entries and storages counted), ``replays`` (saves kept to be
        done again, one a key, at most ``pack.MAX_REPLAYS``), ``watched_ops`` (aten ops the watcher has seen, all
        passes), ``watch_next`` (the next pass is watched), ``in_forward`` (a forward of the model is under way),
        ``most_calls`` (the most calls of one module in the pass under way), ``observers`` and
        ``output_hooks`` (what the estimator watches saves and module outputs with, while it measures),
        ``keys_by_position`` (passes repeat, and only the model's own hooks name saves: ``identity.py``) and
        ``divergences`` (passes that ended keys by position)."""
        path, tracker = self._path, self._tracker
        return {
            "keys": len(path.key_ids),
            "sites": len(path.sites),
            "handles": len(path.dedupe),
            "replays": len(path.replays),
            "storages": len(self._pass.live),
            "watched_ops": path.watcher.ops,
            "watch_next": path.relearn,
            "in_forward": tracker.inside,
            "most_calls": max(tracker.calls.values(), default=0),
            "observers": len(path.observers),
            "output_hooks": len(tracker.output_hooks),
            "keys_by_position": tracker.by_position,
            "divergences": tracker.divergences,
        }

    @property
    def _pass(self) -> PassStats:
        """The most recent forward pass that saved anything (compiled graphs' logged saves recorded first)."""
        self._compiled.drain()
        return self._path.stats

    @_pass.setter
    def _pass(self, stats: PassStats) -> None:
        self._path.stats = stats

    # -- accounting -------------------------------------------------------------------------------------------

    def memory_stats(self, backward: bool = False) -> MemoryStats:
        """Saved-activation bytes of the most recent forward pass that saved anything; ``backward=True``: of what was
        saved while backward ran since that forward (a checkpoint's recomputation), which the pass does not count."""
        return self._path.backward_stats.summary() if backward else self._pass.summary()

    def report(self) -> str:
        """A table of the most recent forward pass: one row a saved tensor (key, shape, dtype, bits, bytes;
        at the adaptive levels also its sensitivity), then the cost of the last adaptation."""
        lines = [f"gactx level {self.config.level}, step {self.step}", self._pass.table(self.sensitivity or None)]
        b = self._path.backward_stats.summary()
        if b.tensors:
            lines.append(
                f"saved while backward ran (recomputation), not in the pass above: {b.tensors} tensors, "
                f"{format_bytes(b.original_bytes)} -> {format_bytes(b.packed_bytes)}"
            )
        launches = self._launch_line()
        if launches:
            lines.append(launches)
        if self.last_adaptation is not None:
            lines.append(cost.report_line(self.last_adaptation, self.config))
        return "\n".join(lines)

    def _launch_line(self) -> str:
        """How the replayed saves of GPU tensors, and compiled graphs' compressed ones, were stored: by native launches
        (``gactx.kernels.native``: C++ through the CUDA driver) or through Triton's launcher, and why not natively; ""
        where none was on a GPU."""
        lines = []
        replays = [r for r in self._path.replays.values() if r.device.type != "cpu" or r.launched]
        if replays:
            launched = sum(r.launched for r in replays)
            line = f"replayed saves on {replays[0].device.type}: {launched} of {len(replays)} packed by native launches"
            if launched < len(replays):
                first = next(r for r in replays if not r.launched)
                why = native.why_not(torch.empty(0, device=first.device)) or "not for their stored form"
                line += f"; the others through Triton's launcher ({why})"
            lines.append(line)
        graph = [save for save in self._compiled.saves.values() if save.native is not None]
        if graph:
            launched = sum(save.native for save in graph)
            line = f"compiled graphs' saves stored by native launches: {launched} of {len(graph)}"
            if launched < len(graph):  # a GPU's: all of them where native launches do not serve, else these forms
                why = native.why_not(torch.empty(0, device="cuda")) or "dynamic shapes or bool masks"
                line += f"; the others through Triton's launcher ({why})"
            lines.append(line)
        return "\n".join(lines)

    # -- hooks ----------------------------------------------------------------------------------------------

    def _new_pass(self) -> None:
        # Cheap bookkeeping only: torch.compile traces module hooks, so the parameter addresses are read
        # again in the first pack of the pass (an eager hook), not here; the op watcher starts only eagerly.
        # Under another controller's hooks (installed later, on this thread) this one does nothing: two op watchers
        # would leave each other's state behind. Under another library's (which may hand saves on) it begins a pass.
        top = _top_hooks()
        if top is None or top[0] is self._graph_hooks[0]:
            self._path.begin_forward()
            if self.config.adaptive:
                self.estimator.forward_begins(self._schedule.due(self.step + 1))
        elif not getattr(top[0], "gactx_hooks", False):
            self._path.begin_forward(watch=False)

    def _pass_end(self) -> None:
        self._path.end_forward()


@functools.cache
def _warn_no_compiled_path() -> None:
    """Once a process: this torch cannot compress inside compiled graphs (``compiled.INLINE``)."""
    warnings.warn(
        f"gactx: torch {torch.__version__} gives saved-tensor hooks no view of the graphs torch.compile makes (torch "
        "2.10 and later do): what compiled regions save is kept as it is, not compressed; eager code is compressed "
        "as usual (see docs/torch-compile.md#torch-older-than-210)",
        RuntimeWarning,
        stacklevel=_caller_level(),
    )
