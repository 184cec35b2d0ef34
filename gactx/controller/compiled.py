"""Compression inside ``torch.compile`` graphs: saved-tensor hooks that AOTAutograd inlines.

Hooks given to ``torch.autograd.graph.saved_tensors_hooks`` as ``torch.fx.GraphModule``s are inlined by
AOTAutograd into the graphs it compiles (``maybe_inline_graph_saved_tensors_hooks``): the pack hook is
traced once per tensor the forward graph saves and joins that graph's end, the unpack hook joins the
backward graph's start, and Inductor schedules and fuses both. A compiled region then holds what it saves
compressed from the moment its forward ends; with ordinary hooks it held every saved tensor until its
forward ended, and its backward unpacked them all before starting.

:class:`HookGraph` is such a GraphModule whose ``forward`` is Python: called eagerly (no graph is being
compiled) it runs the eager pack path; traced by AOTAutograd, :class:`CompiledPath` decides for the saved
node it is shown (``_get_saved_tensor_hook_context``: the forward and backward graphs and the node) with the eager
path's ``decide`` (``decide.py``), under the rule that the op table gives the node (``decide.node_rule``):

- Kept as it is: not floating point, float64, fewer than ``min_numel`` elements, level L0, or the result of
  an op whose backward needs its exact values (the "equality" and "log domain" classes of ``rules.py``,
  read from the node's op and from how the backward graph uses it: ``eq``, ``log``, a division by it).
  Parameters and graph inputs never reach the hook (AOTAutograd's default filtering, "donated": only
  intermediates whose memory the graph owns).
- bool: 1 bit an element, lossless (the bit-packing kernel as a custom op, ``traced.kernel_pack_bool_saved``).
- Attention: ``exp``/``softmax`` results and what is divided out of an ``exp`` result (a softmax the graph
  decomposed) and a fused attention's value and output get at least ``ATTENTION_BITS``; a fused attention's query
  and key, and scores from which backward recomputes an ``exp``, at least ``LOGITS_BITS`` (``rules.py``).
- Kept, too: a value that backward multiplies element-wise into something with more elements (a broadcast factor:
  rotary embeddings' cos and sin).
- Anything else is quantized at the width: the level's, or at adaptive levels the widest the allocation
  gave the eager saves of that shape in the modules that made or used it. By the uniform scheme's kernels
  (Triton, C++) as custom ops the graph calls (``uniform.kernel_quantize_saved``, in the scheme's ``traced.py``;
  ``backend="auto"``, ``"triton"``, ``"cpp"``), or with ``backend="torch"`` in torch ops (``uniform.quantize``)
  that Inductor compiles into the graph's own code and fuses (the same bytes deterministically, longer to compile).

The op rules that need the op's own test or its function (masks decoded from ReLU-like tests, FewBit codes
of GELU inputs, pooling inputs stored as nothing) are eager-only: a compiled graph has decomposed those
ops, and one saved node serves every backward use of the value.

Every save the hook handles ticks in the forward graph (``traced.tick``, or inside the kernel's op,
``uniform.kernel_quantize_saved``, so that one op reads the value; a graph's kept saves of static shapes, and those
the C++ ops store, by its first save's, :meth:`CompiledPath._follows`): at run time it tells the controller which
saves ran (the records of ``memory_stats()`` and ``report()``), and with ``backend="torch"`` its count, a
counter on the device, seeds the noise (the C++ kernels' hash of (seed, index)). Either way a graph draws
new noise every step without recompiling.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gactx.config import Config
from gactx.controller.decide import BOOL_MASK, Decision, decide, kept, node_rule
from gactx.controller.graph_nodes import hoist, modules_of, op_name, sink, source
from gactx.controller.graph_runs import RECORDS_KEPT, GraphRuns
from gactx.controller.identity import Key, ModuleTracker, passes_saves_on
from gactx.controller.plan import GraphSlot
from gactx.controller.policy import value_reason
from gactx.controller.stats import KeyRecord
from gactx.kernels import cpu, native, traced
from gactx.kernels.format import FLOAT_DTYPES, expected_nbytes
from gactx.kernels.schemes.uniform import traced as uniform

__all__ = ["INLINE", "EagerHook", "HookGraph", "CompiledPath", "GraphSave", "hook"]

# Tags of what a compiled pack returns (ints: every leaf that is not a tensor becomes a constant of the
# backward graph). CPP_*: the C++ ops of CPU tensors (``gactx_cpu::*_saved``), which the graph calls with no Python.
KEPT, QUANTIZED, BOOL, KERNEL, BOOL_KERNEL, CPP_KEPT, CPP, CPP_BOOL = range(8)
_MASK32 = 0xFFFFFFFF
# A graph's saves of static shapes (kept, or stored by the C++ ops) are recorded with its first one, by no log entry
# of their own (CompiledPath._follows); False: an entry each.
FOLLOW = True


try:
    from torch._functorch._aot_autograd import graph_compile as _graph_compile

    _hook_context = _graph_compile._get_saved_tensor_hook_context
except (ImportError, AttributeError):  # a torch without graph hooks' context: every call is eager
    _graph_compile = None

    def _hook_context() -> dict | None:
        return None


def _context_local() -> threading.local | None:
    """The ``threading.local`` that holds ``_hook_context()``'s value, where this torch keeps it there (checked once
    against the context manager), else ``None``. Read as this thread's dict of it, whether AOTAutograd traces a hook
    is a dictionary lookup; ``_hook_context()`` takes ``getattr`` of a missing attribute, which raises inside, twice a
    saved tensor."""
    local = getattr(_graph_compile, "_thread_local", None)
    if not isinstance(local, threading.local):
        return None
    probe = {}
    try:
        with _graph_compile._saved_tensor_hook_context(probe):
            seen = local.__dict__.get("state") is probe
    except Exception:
        return None
    return local if seen and local.__dict__.get("state") is None else None


# Whether TorchDynamo intercepts Python frames now (not None): inside a function compiled by torch.compile,
# between its graphs. Outside one nothing would trace a hook, so the hooks skip torch.compiler.disable's wrapper,
# which costs a few microseconds a call.
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _frame_callback
except ImportError:  # a torch without it: every eager call goes through torch.compiler.disable

    def _frame_callback() -> object:
        return True


_LOCAL = _context_local()
# Whether this torch's AOTAutograd gives a hook it traces the graph and node it is traced for (its saved-tensor hook
# context), which the compiled path decides by. Without it the hooks are plain callables (EagerHook) that AOTAutograd
# does not inline: a compiled graph keeps its saves until its forward ends, then hands each to the eager path.
INLINE = _graph_compile is not None


def _uncached(x):
    """The body of a :class:`HookGraph`'s graph. Never run; an op AOTAutograd's cache does not know, so that
    graphs compiled with gactx's hooks are never taken from its cache: their saves are decided, and their
    records registered, only by tracing them."""
    return x


class HookGraph(torch.fx.GraphModule):
    """A saved-tensor hook AOTAutograd can inline: ``forward`` runs ``compiled`` while the hook is traced into a
    compiled graph (once per saved tensor) and ``eager`` otherwise; the graph is a placeholder for the compile
    caches. Eagerly, compression is data movement outside any graph: where TorchDynamo is active (the eager parts
    of a compiled function) ``eager`` runs under ``torch.compiler.disable``, so that torch.compile does not try to
    trace it (and break the graph on storage addresses); elsewhere it runs as it is."""

    gactx_hooks = True  # what checkpoint.py looks for among the hooks in scope

    def __init__(self, eager: Callable, compiled: Callable) -> None:
        graph = torch.fx.Graph()
        graph.output(graph.call_function(_uncached, (graph.placeholder("x"),)))
        super().__init__(torch.nn.Module(), graph)
        self.eager, self.compiled, self.disabled = eager, compiled, torch.compiler.disable(eager)

    def recompile(self):  # the code is forward's, not the graph's
        return None

    def forward(self, x):
        return self.__call__(x)

    def call_natively(self, built) -> None:
        """This hook's ``__call__`` made the C++ extension's (``built``, ``csrc/hooks.cpp``): the same choice with no
        Python frame, on the class ``torch.fx.GraphModule`` makes for each instance. Where this torch keeps the traced
        hooks' context in a ``threading.local`` only (``_LOCAL``)."""
        if _LOCAL is not None:
            type(self).__call__ = built.hook_call(self, _LOCAL, _frame_callback)

    @passes_saves_on
    def __call__(self, x):  # autograd calls a hook for every saved tensor: no module call machinery
        if (_hook_context() if _LOCAL is None else _LOCAL.__dict__.get("state")) is not None:
            return self.compiled(x)
        if _frame_callback() is not None:
            return self.disabled(x)
        return self.eager(x)


class EagerHook:
    """A saved-tensor hook that AOTAutograd does not inline (not a GraphModule), for a torch without the context
    the compiled path needs (:data:`INLINE`): it runs the eager path, under ``torch.compiler.disable`` where
    TorchDynamo is active (a compiled graph's saves, handed over when its forward ends)."""

    gactx_hooks = True  # what checkpoint.py looks for among the hooks in scope

    def __init__(self, eager: Callable) -> None:
        self.eager, self.disabled = eager, torch.compiler.disable(eager)

    def call_natively(self, built) -> None:  # the C++ call of a hook is HookGraph's
        return None

    @passes_saves_on
    def __call__(self, x):
        return self.disabled(x) if _frame_callback() is not None else self.eager(x)


def hook(eager: Callable, compiled: Callable) -> HookGraph | EagerHook:
    """A hook that runs ``eager`` when called and ``compiled`` when AOTAutograd traces it into a graph; where this torch
    cannot give the compiled path its context (:data:`INLINE`), an :class:`EagerHook` of ``eager``."""
    return HookGraph(eager, compiled) if INLINE else EagerHook(eager)


@dataclass
class GraphSave:
    """One saved node of one compiled forward graph, as decided when it was traced."""

    graph: int  # the forward graph (one token a graph)
    module: str  # the module that made it, as the compiled region names it
    index: int  # its place among the graph's saves of that module
    dtype: torch.dtype
    decision: Decision
    group_size: int
    op: str
    extra: int = 8  # bytes the graph holds beside what is stored: the tick's count (C++ ops: a kept save's marker)
    # A compressed save on a GPU (or under native.recording): whether native launches store it (else Triton's launcher)
    native: bool | None = None
    # (frame, call, shape, extra) -> the record made for them: a graph runs again with the same ones step after step
    _records: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def bits(self) -> int | None:
        return self.decision.bits

    @property
    def compressed(self) -> bool:
        return not self.decision.reason

    def record(self, frame: tuple[str, int] | None, call: int, shape: tuple[int, ...]) -> KeyRecord:
        """The record of one run, ``shape`` the saved tensor's (known at run time, dynamic or not). Under an eager
        module (``frame``: its name and call; a compiled block), the module is named from it, as eager saves are.
        The record of a run like an earlier one is that one's (records are not changed once made)."""
        made = self._records.get((frame, call, shape, self.extra))
        if made is not None:
            return made
        numel = math.prod(shape)
        nbytes = numel * self.dtype.itemsize
        stored = expected_nbytes(numel, self.dtype, self.bits, self.group_size) if self.compressed else nbytes
        module = self.module
        if frame is not None:
            module, call = ".".join(p for p in (frame[0], self.module) if p), frame[1]
        key, d = Key(module, call, self.index, shape), self.decision
        made = KeyRecord(key, self.dtype, d.bits, nbytes, self.extra + stored, nbytes, self.op, d.cls, "", d.reason)
        if len(self._records) >= RECORDS_KEPT:  # shapes that keep changing: the newest kept
            self._records.clear()
        self._records[(frame, call, shape, self.extra)] = made
        return made


class CompiledPath:
    """Decides, while AOTAutograd traces, what each saved node of a compiled graph becomes; collects, while
    compiled graphs run, which saves ran into the controller's pass statistics.

    ``path``: the eager pack path, whose ``stats`` and pass boundaries compiled saves share, and whose plan gives
    the width of a quantized save (``plan.compiled_width``)."""

    def __init__(self, config: Config, tracker: ModuleTracker, path) -> None:
        self.config = config
        self.tracker = tracker
        self.path = path
        self.saves: dict[int, GraphSave] = {}  # token -> save
        self._decided: dict[tuple, tuple[int, GraphSave]] = {}  # (graph, node name) -> (token, save)
        self._graphs: dict[int, int] = {}  # id of a forward graph -> its number
        self._indices: dict[tuple, int] = {}  # (graph, module) -> saves so far
        self._starts: dict[tuple, int] = {}  # (graph, node name) -> the forward graph's output position
        self._pending: list[tuple] = []  # (backward graph, saved node name) whose unpack nodes are to sink
        self._leads = weakref.WeakKeyDictionary()  # a forward graph -> the token of its first save that may lead
        self._followers: dict[int, list[tuple[int, tuple]]] = {}  # a lead's token -> (token, shape) of its followers
        self._following: set[int] = set()  # the followers' tokens
        self.runs = GraphRuns(self.saves, self._followers, tracker, path)  # which saves ran (graph_runs.py)
        self.drain = self.runs.drain

    # -- tracing ------------------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        ctx = _hook_context()
        self._sink_pending(ctx["_bw_graph"])
        token, save = self._decide(t, ctx["_node"], ctx["_fw_graph"], ctx["_bw_graph"])
        cfg = self.config
        cpp = t.device.type == "cpu" and cfg.backend in ("auto", "cpp") and cpu.available()
        launches, gpu_ops = self._launches(t, save, token)
        if save.compressed and (t.device.type != "cpu" or launches is not None):
            save.native = launches is not None
        ops = cpp or gpu_ops
        follows = (ops or not save.compressed) and self._follows(token, t, ctx["_fw_graph"])
        if follows and not save.compressed:
            return t  # recorded with its graph's first save (_follows): no op, nothing beside it
        if ops:
            return self._pack_cpp(t, token, save, logged=not follows, launches=launches)
        # The count comes before the tensors: AOTAutograd adds the backward graph's inputs for a save before the
        # one it already has, which is the saved tensor itself where the hook returns it.
        if not save.compressed:
            return (KEPT, traced.tick(t, token), t)
        shape, dtype = tuple(t.shape), FLOAT_DTYPES.index(t.dtype) if t.dtype != torch.bool else -1
        if cfg.backend != "torch":
            # The kernels (C++, Triton), opaque to Inductor, with the tick in the same op: the value is read
            # once. Bool masks too: traced, a dropout's mask would be drawn again in each kernel reading it.
            if t.dtype == torch.bool:
                packed, count = traced.kernel_pack_bool_saved(t, cfg.backend, token)
                return (BOOL_KERNEL, count, packed, t.numel(), shape)
            salt = _salt(cfg.seed, token)
            codes, meta, count = uniform.kernel_quantize_saved(
                t, save.bits, cfg.group_size, cfg.stochastic, salt, cfg.backend, token
            )
            return (KERNEL, count, codes, meta, save.bits, cfg.group_size, t.numel(), shape, dtype)
        # The format in torch ops, which Inductor compiles and fuses.
        count = traced.tick(t, token)
        if t.dtype == torch.bool:
            return (BOOL, count, traced.pack_bool(t), t.numel(), shape)
        seed = (count << 32) | _salt(cfg.seed, token)
        codes, meta = uniform.quantize(t.reshape(-1), save.bits, cfg.group_size, cfg.stochastic, seed)
        return (QUANTIZED, count, codes, meta, save.bits, cfg.group_size, t.numel(), shape, dtype)

    def _follows(self, token: int, t: torch.Tensor, fw_graph) -> bool:
        """Whether a save of ``fw_graph`` (kept, or stored by the C++ ops) is recorded with the graph's first such
        save, its lead, instead of by a log entry of its own: every node of a graph runs when the graph runs, so the
        lead's entry tells that this save ran too, and the release of what the lead returned that the graph's
        backward ran (graphs are released whole; the pass boundaries read no more). A kept follower has no op; a
        compressed one's op logs nothing. A save of a dynamic shape is logged: its record needs the shape it runs
        with. What a follower saves: on a CPU a kept save's op costs the graph's code a call, its size checks and one
        more saved tensor; a compressed save's log entry costs a parse and a record, read once a step."""
        if not FOLLOW:
            return False
        lead = self._leads.setdefault(fw_graph, token)
        if lead == token:
            return False
        if token in self._following:
            return True
        if not all(isinstance(s, int) for s in t.shape):
            return False
        self._following.add(token)
        self._followers.setdefault(lead, []).append((token, tuple(t.shape)))
        self.runs.followed_anew(lead)
        self.saves[token].extra = 0
        return True

    def _launches(self, t: torch.Tensor, save: GraphSave, token: int):
        """``(packer, ops)``: where native launches serve ``t`` (a GPU's tensor; a CPU's under ``native.recording``),
        the C++ ops take its save (``ops``): a compressed float save of a static shape stored by the packer's launches
        (``native.graph_packer``: under CUDA graphs its seed drawn on the device), a kept one by its marker. Else
        ``(None, False)``: the Python ops take it."""
        cfg = self.config
        if cfg.backend not in ("auto", "triton") or not cpu.available():
            return None, False
        if native.why_not(t):  # its device read, nothing traced
            return None, False
        if not save.compressed:
            return None, t.device.type != "cpu"
        if t.dtype not in FLOAT_DTYPES or not all(type(s) is int for s in t.shape):
            return None, False
        packer = native.graph_packer(t, save.bits, cfg.group_size, cfg.stochastic, math.prod(t.shape),
                                     _salt(cfg.seed, token))  # fmt: skip
        return packer, packer is not None

    def _pack_cpp(self, t: torch.Tensor, token: int, save: GraphSave, logged: bool, launches=None):
        """A CPU tensor's save by the C++ ops, which the graph calls with no Python (a GPU's where native launches serve
        it, ``launches`` the packer whose kernels store a compressed one): each returns one tensor, and logs
        that it ran and when the graph released it under ``token`` where ``logged`` (else a follower, logged by its
        lead); the controller reads the log when it next looks at its passes (:meth:`drain`). A compressed save's ops
        take its token, under which what it stores by is registered now (``cpu.register_saved``): each argument costs
        the graph's Python wrapper its parsing."""
        if not self.runs.logging:
            self.runs.logging = True
            self.path.before_save = self.tracker.on_boundary = self.drain
        ops, cfg = torch.ops.gactx_cpu, self.config
        if not save.compressed:
            save.extra = 1  # the marker: what the graph holds while it holds the save
            return (CPP_KEPT, ops.keep_saved(t, token if logged else -1), t)
        save.extra = 0
        if t.dtype == torch.bool:
            return (CPP_BOOL, ops.pack_bool_saved(t, token if logged else -1), tuple(t.shape))
        static = cpu.register_saved(token, save.bits, cfg.group_size, cfg.stochastic, _salt(cfg.seed, token), logged,
                                    FLOAT_DTYPES.index(t.dtype), t.shape, launches)  # fmt: skip
        return (CPP, ops.quantize_saved(t, token), token, None if static else tuple(t.shape))

    def unpack(self, packed):
        ctx = _hook_context()
        start = self._starts.pop((id(ctx["_fw_graph"]), ctx["_node"].name), None)
        if start is not None:  # the first of the two calls: the pack nodes are in the forward graph now
            hoist(ctx["_fw_graph"], start)
            self._pending.append((ctx["_bw_graph"], ctx["_node"].name))
        if isinstance(packed, torch.Tensor):
            return packed
        tag = packed[0]
        if tag in (KEPT, CPP_KEPT):
            return packed[2]
        if tag == CPP_BOOL:  # decoded in the saved shape: no view after
            _, data, shape = packed
            return torch.ops.gactx_cpu.unpack_bool_saved(data, shape)
        if tag == CPP:  # decoded in the saved shape: registered under the token, or given where dynamic
            _, stored, token, shape = packed
            if shape is None:
                return torch.ops.gactx_cpu.dequantize_saved(stored, token)
            return torch.ops.gactx_cpu.dequantize_shaped(stored, token, shape)
        if tag in (BOOL, BOOL_KERNEL):
            _, _, data, n, shape = packed
            if tag == BOOL_KERNEL:
                return traced.kernel_unpack_bool(data, n, self.config.backend).view(shape)
            return traced.unpack_bool(data, n).view(shape)
        _, _, codes, meta, bits, group_size, n, shape, dtype = packed
        if tag == KERNEL:
            flat = uniform.kernel_dequantize(codes, meta, bits, group_size, n, FLOAT_DTYPES[dtype], self.config.backend)
        else:
            flat = uniform.dequantize(codes, meta, bits, group_size, n, FLOAT_DTYPES[dtype])
        return flat.view(shape)

    def _decide(self, t: torch.Tensor, node, fw_graph, bw_graph) -> tuple[int, GraphSave]:
        """The token and decision of a saved node (made once: AOTAutograd calls the hook twice a node)."""
        found = self._decided.get((id(fw_graph), node.name))
        if found is not None:
            return found
        self._starts[(id(fw_graph), node.name)] = len(fw_graph.nodes) - 1  # where its pack nodes will go
        graph = self._graphs.setdefault(id(fw_graph), len(self._graphs))
        modules = modules_of(node)
        module = modules[0] if modules else ""
        index = self._indices[(graph, module)] = self._indices.get((graph, module), -1) + 1
        decision = self._rule(t, node, bw_graph, modules)
        save = GraphSave(graph, module, index, t.dtype, decision, self.config.group_size, op_name(source(node)))
        token = traced.new_token(self.runs.ran)
        self.saves[token] = save
        self._decided[(id(fw_graph), node.name)] = (token, save)
        return token, save

    def _rule(self, t: torch.Tensor, node, bw_graph, modules: list[str]) -> Decision:
        """The decision for a saved node: the policy's (no parameter reaches the hook), then ``decide`` under the op
        table's rule of the node (``decide.node_rule``) at the plan's width for its modules and shape."""
        cfg = self.config
        if cfg.bits is None:
            return kept("L0")
        reason = value_reason(t, cfg.min_numel)
        if reason is not None:
            return kept(reason)
        rule = BOOL_MASK if t.dtype == torch.bool else node_rule(node, bw_graph)
        return decide(t, rule, self.path.plan, GraphSlot(tuple(modules), _hint(t.shape), t.dtype), cfg)

    def _sink_pending(self, bw_graph) -> None:
        """Move the unpack nodes of the saves before this one (inlined at the start of the backward graph) to
        right before their first use. At the start, every saved tensor would be decoded in full before the
        backward begins. (The last save's stay there: backward uses it first.)"""
        pending, self._pending = self._pending, []
        for graph, name in pending:
            if graph is bw_graph:
                sink(graph, name)
            else:
                self._pending.append((graph, name))


def _hint(shape) -> tuple[int, ...]:
    """A shape's sizes, a dynamic size as the value it was traced with."""
    return tuple(s if isinstance(s, int) else s.node.hint for s in shape)


def _salt(seed: int, token: int) -> int:
    h = (seed * 0x9E3779B1 + token * 0x85EBCA77) & 0xFFFFFFFFFFFFFFFF
    return (h ^ (h >> 29)) & _MASK32
