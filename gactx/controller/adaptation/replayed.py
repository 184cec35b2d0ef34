"""An estimate's passes against the exact base from one forward of the closure: its backward, replayed for each probe,
and where it can, only the part of it below what the probe perturbs.

A probe pass against the exact base (``sensitivity.EXACT_BASE``) changes nothing in the forward: only what backward
reads of the probed tensor. So the closure runs once, under a plan that defers (``Plan.deferred``: every save of an
allocated class kept for later probes, ``gactx/controller/probes.py``), with its backward calls recorded and their
graphs kept (``retain_graph``); each later pass replays those calls under the probe then in force. A pass then costs a
backward, not a forward and a backward: on the LoRA decoder (small) the forward was two thirds of a pass.

A probe changes what backward computes only from the nodes that read a probed save on (:data:`PARTIAL`). Every node
above them gets the gradient it gets in the base, and backward is linear in the gradient a node is given, so::

    g_probe - g_base = B_probe(sum_N N_probe(g_N) - N_exact(g_N))

where ``N`` runs over the nodes that read a probed save, ``g_N`` is the gradient ``N`` is given in the base, and
``B_probe`` is backward from those nodes' inputs on, under the probe (a node below another one that reads a probed
save reads it probed, as in a whole pass). So a pass runs each such node twice on ``g_N`` and backward from their
inputs down (``torch.autograd.grad`` from their edges), not the whole backward: a tensor saved near the loss costs the
nodes below it, one whose noise reaches only its weight's gradient (a product's activation operand) costs its node
alone. The difference is a whole pass's up to rounding (tested), without the cancellation of two whole gradients.
Such a pass can also stop at a cut below the probed nodes (``cuts.py``), handing back what the cut is given, and a
backward from the cut alone continues it (:meth:`Replayed.split`, :meth:`Replayed.below`).

The ``g_N`` are read by a backward from the closure's roots that stops below the nodes it reads them for (``inputs``
at their edges), with a hook on each, for at most :data:`WINDOW` nodes at a time: the nodes of the pass that needs
them, and those of the slots the estimate says it probes next (:meth:`Replayed.expect`); the window before is dropped.
Kept for every node at once, they were about one more set of the closure's activations (the LoRA decoder's adaptation
peak 36 to 75 MiB). A pass whose probes need more nodes than a window (linear layers' inputs probed together) replays
the whole backward, as does a probe of a save that a recomputation inside backward made (a reentrant checkpoint), one
read by a node that is not a C++ node, that ran more than once in a backward, or whose call outside the engine does not
give what the engine's call gave (checked once a node). So does a closure whose gradients pass through hooks that are
not linear in the gradient (clipping in a tensor hook): the difference of two clipped gradients is not the clipped
difference. A pass from the nodes that raises (a device or a kind of node no check here foresaw) is logged at INFO, and
whole replays measure the rest of the estimate.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from gactx.controller.adaptation import cuts, rows
from gactx.controller.identity import in_backward

__all__ = ["PARTIAL", "REPLAY", "WINDOW", "Replayed"]

logger = logging.getLogger(__name__)

# Replay the closure's backward for each pass of an estimate against the exact base; False: run the closure whole.
REPLAY = True
# A replayed pass runs backward from the nodes that read what it probes (module docstring); False: the whole replay.
PARTIAL = True
# The most nodes whose given gradients are kept at a time (module docstring). 32 against 16: later adaptations 4% to
# 9% faster (ResNet-50 small 3 window reads instead of 5), their peak 0 to 4 MiB higher (the LoRA decoder's 51-54
# MiB against 54-58; gactx.PeakMemory, CPU); the first adaptations' peaks 0.2 and 1.4 MiB higher.
WINDOW = 32
# A pass calls a node exactly on its given gradient no more than once a window: the next pass that calls it too takes
# the last one's results (the linear inputs probed together and their sketches' calibration pairs, the queries and
# keys that one attention product reads); False: twice a pass.
KEEP_EXACT = True
# A pass asks for an embedding table's gradient as the rows its indices reach (rows.py); False: the whole table.
ROWS = True


class Replayed:
    """``backprop`` as the passes of one estimate (called as the closure is, once a pass). The first call runs it whole,
    under a deferring plan (``defer(True, watch)``, then ``defer(False)``), recording its backward calls and which
    backward nodes read each slot's deferred saves; every later call replays them. The first call's gradients are a
    replay's too, so that whatever the closure does to the gradients besides its backward calls (clipping after them)
    is in no pass: where it did nothing to them (no ``.grad`` set when its first backward call began, and each the same
    tensor at the same version from one call's end to the next call and to the closure's end), they are what its
    backward calls left; else the calls are replayed once after it returns. Where the closure made no backward call
    that can be replayed (``torch.autograd.grad``, ``create_graph``), every call runs it whole, under the probe then in
    force. :meth:`difference` is a pass from the nodes a probe perturbs. :meth:`close` frees the kept graphs."""

    def __init__(
        self, model: nn.Module, backprop: Callable[[], object], defer: Callable[[bool, Callable | None], None]
    ) -> None:
        self.model, self.backprop, self.defer = model, backprop, defer
        self.calls: list[tuple] | None = None  # (tensors, grad_tensors, inputs) of each backward call, once recorded
        self._nodes: dict[Hashable, list] = {}  # slot -> the nodes that read its deferred saves
        self._broken: set[Hashable] = set()  # slots a pass from their nodes cannot probe (module docstring)
        self._given: dict = {}  # node -> the gradient it is given in the base (the window's nodes)
        self._exact: dict = {}  # node -> its exact call's results on that gradient, the last pass's nodes (copies)
        self._tables: dict | None = None  # position in the estimate's parameters -> rows.Rows, once a pass needs them
        self._cuts: dict | None = None  # slot -> cuts.Cut below its nodes, once a pass asks (cut_of)
        self._results: dict = {}  # node -> a fingerprint of what the engine's call gave (_fingerprint), until checked
        self._checked: dict = {}  # node -> whether a call outside the engine gives what the engine's did (_same)
        self._bad: set = set()  # nodes not given one gradient in a backward: never, or more than once
        self._upcoming: list = []  # the slots the estimate probes next, in order (expect)
        self._failed = False  # a pass from the nodes raised: whole replays for the rest of the estimate
        self._untouched = False  # the recording run's gradients are its backward calls' alone (class docstring)

    def __call__(self) -> None:
        if self.calls is None:
            self.calls = self._record()
            if not self.calls or self._untouched:
                return  # the whole closure ran, with its own gradients (untouched: a replay's)
            for p in self.model.parameters():
                p.grad = None
        elif not self.calls:
            self.backprop()
            return
        for tensors, grad_tensors, inputs in self.calls:
            torch.autograd.backward(tensors, grad_tensors, retain_graph=True, inputs=inputs)

    def expect(self, slots: Sequence[Hashable]) -> None:
        """The slots the next passes probe, in their order: a window of given gradients read for one pass holds
        theirs too (module docstring)."""
        self._upcoming = list(slots)

    def difference(
        self, probes: dict, set_probe: Callable[[dict], None], params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None] | None:
        """The gradient of each of ``params`` (the estimate's layout) under ``probes`` less the base's, from the nodes
        that read the probed slots (module docstring; ``None`` where no probed noise reaches it), the probes left in
        force as a pass leaves them; ``None`` where such a pass cannot measure them (then a whole replay does)."""
        if not PARTIAL or not self.calls or self._failed:
            return None
        self._upcoming = [slot for slot in self._upcoming if slot not in probes]  # probed now, not next
        try:
            return self._difference(probes, set_probe, params)
        except (RuntimeError, TypeError) as e:
            return self._fail(e)

    def _fail(self, error: Exception) -> None:
        """A pass from the nodes raised: a node that cannot be called outside the engine in a way no check here
        foresaw (a device or a kind of node not met). The whole replay stands for every later pass, and raises what
        is the model's."""
        self._failed = True
        logger.info("gactx: a probe pass from the probed nodes failed (%s); whole replays from here on", error)

    def _difference(
        self, probes: dict, set_probe: Callable[[dict], None], params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None] | None:
        """:meth:`difference`, where it may run."""
        given = self._deltas(probes, set_probe)
        if given is None:
            return None
        edges, deltas = given
        if not edges:
            return [None] * len(params)
        tables = self._rows(params)
        inputs = [tables[i].edge if i in tables else p for i, p in enumerate(params)]
        out = list(torch.autograd.grad(edges, inputs, deltas, retain_graph=True, allow_unused=True))
        for i, table in tables.items():  # an embedding's weight: the rows its indices reach (rows.py)
            out[i] = table.of(out[i])
        return out

    def cut_of(self, slot: Hashable, params: Sequence[torch.Tensor]) -> cuts.Cut | None:
        """The cut below ``slot``'s nodes (``cuts.py``), where a pass from them can probe it; found for every slot by
        the first call."""
        if self._cuts is None:
            roots = self._roots()
            self._cuts = cuts.cuts(roots, self._nodes, params) if roots else {}
        if not PARTIAL or self._failed or slot in self._broken:
            return None
        return self._cuts.get(slot)

    def split(
        self, slot: Hashable, probe, set_probe: Callable[[dict], None], params: Sequence[torch.Tensor]
    ) -> tuple[list, torch.Tensor | None] | None:
        """A pass with ``slot`` probed, split at its cut (:meth:`cut_of`): the difference from the base of each of
        ``params`` above it (``None`` below it, and where the noise does not reach), and the difference of the gradient
        the cut is given (``None``: nothing reached it); ``None`` where such a pass cannot measure it."""
        cut = self.cut_of(slot, params)
        if cut is None:
            return None
        self._upcoming = [s for s in self._upcoming if s != slot]  # probed now, not next
        try:
            given = self._deltas({slot: probe}, set_probe)
            if given is None:
                return None
            edges, deltas = given
            out = [None] * len(params)
            if not edges:
                return out, None
            inputs = [*(params[i] for i in cut.near), cut.edge]
            found = torch.autograd.grad(edges, inputs, deltas, retain_graph=True, allow_unused=True)
        except (RuntimeError, TypeError) as e:
            return self._fail(e)
        for i, d in zip(cut.near, found[:-1], strict=True):
            out[i] = d
        return out, found[-1]

    def below(self, slot: Hashable, delta: torch.Tensor, params: Sequence[torch.Tensor]) -> list | None:
        """The difference ``delta`` (the gradient ``slot``'s cut is given, :meth:`split`'s) makes to each of
        ``params`` below the cut (``None`` above it, and where it does not reach): backward from the cut alone, under
        the probe in force; ``None`` where that raised (then whole replays measure the rest, as after
        :meth:`difference`)."""
        cut = self.cut_of(slot, params)
        out = [None] * len(params)
        if cut is None or not cut.far:
            return None if cut is None else out
        try:
            found = torch.autograd.grad(
                [cut.edge], [params[i] for i in cut.far], [delta], retain_graph=True, allow_unused=True
            )
        except (RuntimeError, TypeError) as e:
            return self._fail(e)
        for i, d in zip(cut.far, found, strict=True):
            out[i] = d
        return out

    def _deltas(self, probes: dict, set_probe: Callable[[dict], None]) -> tuple[list, list] | None:
        """The edges below the nodes that read the probed slots, and the difference each is handed by them under the
        probes against the base (module docstring): where the noise reaches, the probes left in force; ``None`` where
        a pass from the nodes cannot stand for the whole one."""
        nodes = self._needed(probes)
        if nodes is None:
            return None
        if any(node not in self._given for node in nodes):
            set_probe({})  # the base's: no probe of a pass before
            self._read(nodes)
        if any(node in self._bad or self._checked.get(node) is False for node in nodes):
            return None
        # Each node's result under the probes, copied before it runs again: a node may hand back buffers that its
        # next call writes over.
        set_probe(probes)
        results = [self._call(node) for node in nodes]
        if any(out is None for out in results):
            return None
        results = [_copied(out) for out in results]
        # The exact calls: the last pass's where it called the same node on the same gradient (the linear inputs
        # probed together, and their calibration pairs, call the same nodes pass after pass), copied as above.
        kept, self._exact = self._exact if KEEP_EXACT else {}, {}
        if any(node not in kept for node in nodes):
            set_probe({})
        exact = [kept[node] if node in kept else self._call(node) for node in nodes]
        if any(out is None for out in exact) or not all(map(self._same, nodes, exact)):
            return None
        self._exact = {node: out if node in kept else _copied(out) for node, out in zip(nodes, exact, strict=True)}
        set_probe(probes)  # backward below them reads the probed saves that lie there probed
        edges, deltas = [], []
        for node, mine, base in zip(nodes, results, exact, strict=True):
            for (after, n), probed, was in zip(node.next_functions, mine, base, strict=True):
                if after is None or probed is None:
                    continue
                delta = probed if was is None else probed - was
                if bool(delta.any()):  # an edge the probe's noise does not reach costs no backward below it
                    edges.append(GradientEdge(after, n))
                    deltas.append(delta)
        return edges, deltas

    def _rows(self, params: Sequence[torch.Tensor]) -> dict:
        """:func:`rows.tables` of the estimate's parameters below the recorded calls, found by the first pass that
        asks."""
        if self._tables is None:
            self._tables = rows.tables(self._roots(), params) if ROWS else {}
        return self._tables

    def _roots(self) -> list:
        """The nodes the recorded backward calls start from."""
        return [_node(t) for tensors, _, _ in self.calls or () for t in _each(tensors)]

    def _needed(self, probes: dict) -> list | None:
        """The nodes that read the probed slots' saves, or ``None`` where a pass from them cannot stand for the whole
        one (module docstring)."""
        nodes: list = []
        for slot in probes:
            if slot in self._broken or slot not in self._nodes:
                return None
            for node in self._nodes[slot]:
                if node in self._bad or self._checked.get(node) is False:
                    return None
                if all(node is not n for n in nodes):
                    nodes.append(node)
        return nodes if len(nodes) <= WINDOW else None

    def _read(self, nodes: list) -> None:
        """Read the gradient each of ``nodes`` is given in the base, and those of the nodes of the slots expected next,
        up to :data:`WINDOW` nodes, by a backward from the closure's roots to their edges (module docstring); the
        window before is dropped."""
        window = list(nodes)
        self._exact = {}  # called on the gradients of the window before
        for slot in self._upcoming:
            if slot in self._broken:
                continue
            more = [n for n in self._nodes.get(slot, ()) if n not in self._bad and all(n is not m for m in window)]
            if len(window) + len(more) > WINDOW:
                break
            window += more
        self._given, seen = {}, set()

        def keep(node, grad_inputs: tuple, grad_outputs: tuple) -> None:
            if node in seen:  # given a gradient twice (two of the closure's backward calls through it)
                self._bad.add(node)
            seen.add(node)
            self._given[node] = grad_outputs
            if node not in self._checked:
                self._results[node] = _fingerprint(grad_inputs)

        edges = [GradientEdge(after, n) for node in window for after, n in node.next_functions if after is not None]
        if not edges:  # nothing below them: a pass from them has nothing to reach
            self._bad.update(window)
            return
        hooks = [node.register_hook(functools.partial(keep, node)) for node in window]
        try:
            for tensors, grad_tensors, _ in self.calls:
                torch.autograd.grad(tensors, edges, grad_tensors, retain_graph=True, allow_unused=True)
        finally:
            for hook in hooks:
                hook.remove()
        self._bad.update(node for node in window if node not in seen)

    def _call(self, node) -> tuple | None:
        """``node`` called on the gradient it is given in the base, each result as the engine hands it to the next
        node: summed over the dimensions its input was broadcast along in the forward, in the input's dtype and on its
        device; ``None`` where a result goes to a nested tensor, or the results are not one an edge."""
        with torch.no_grad():  # as the engine calls it: its results build no graph of their own
            results = _outputs(node(*self._given[node]))
        if len(results) != len(node.next_functions):
            return None
        out = []
        for (after, n), t in zip(node.next_functions, results, strict=True):
            if after is not None and t is not None:
                meta = after._input_metadata[n]
                if meta.is_nested_tensor:
                    return None
                if t.shape != meta.shape:
                    t = t.sum_to_size(meta.shape)
                t = t.to(meta.device, meta.dtype)  # a CPU scalar's gradient goes back to the host, as the engine's
            out.append(t)
        return tuple(out)

    def _same(self, node, exact: tuple) -> bool:
        """Whether a call of ``node`` outside the engine gave what the engine's call gave (a call that builds a graph
        of its own, as oneDNN's LSTM's did outside ``torch.no_grad``, need not); checked at its first call."""
        if node not in self._checked:
            self._checked[node] = bool(torch.equal(_fingerprint(exact), self._results.pop(node)))
        return self._checked[node]

    def close(self) -> None:
        """Drop the recorded calls, and with them the graphs and the saves they keep."""
        self.calls, self._nodes, self._given, self._results, self._checked, self._bad = [], {}, {}, {}, {}, set()
        self._exact, self._tables, self._cuts = {}, None, None

    def _watch(self, slot: Hashable, forward: bool) -> None:
        """A deferred save of ``slot`` is unpacked (``PackPath.unpacked``), in the recording run's backward."""
        node = torch._C._current_autograd_node()
        if node is None or not forward or isinstance(node, torch._C._FunctionBase):
            self._broken.add(slot)  # read outside a backward, made by a recomputation, or a Python function's node
            return
        nodes = self._nodes.setdefault(slot, [])
        if all(node is not n for n in nodes):
            nodes.append(node)

    def _record(self) -> list[tuple]:
        calls, replayable = [], True
        original = torch.autograd.backward
        params = list(self.model.parameters())
        # Each .grad as the last backward call left it, for the next call and the closure's end to find it alike: none
        # set, before the first.
        left, untouched = _grads([]), True

        def recording(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                      inputs=None):  # fmt: skip
            nonlocal replayable, untouched, left
            if in_backward():  # a reentrant checkpoint's own, inside the closure's backward: replayed with it
                return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            replayable = replayable and not create_graph and grad_variables is None
            untouched = untouched and _alike(_grads(params), left)
            calls.append((tensors, grad_tensors, inputs))
            try:
                return original(tensors, grad_tensors, retain_graph=True, create_graph=create_graph, inputs=inputs)
            finally:
                left = _grads(params)

        self.defer(True, self._watch if PARTIAL else None)
        torch.autograd.backward = recording
        try:
            self.backprop()
        finally:
            torch.autograd.backward = original
            self.defer(False, None)
        self._untouched = untouched and _alike(_grads(params), left)
        return calls if replayable else []


def _grads(params: list[torch.Tensor]) -> list[tuple]:
    """Each of ``params`` that has a ``.grad``, with it and its version: what tells a gradient set, unset, written over
    or changed in place (the tensor itself, not its id, which a new one may take once it is freed)."""
    return [(p, g, g._version) for p in params if (g := p.grad) is not None]


def _alike(now: list[tuple], then: list[tuple]) -> bool:
    """Whether two :func:`_grads` hold the same gradients, unchanged."""
    if len(now) != len(then):
        return False
    return all(a is c and b is d and v == w for (a, b, v), (c, d, w) in zip(now, then, strict=True))


def _fingerprint(results: tuple) -> torch.Tensor:
    """The sums of a node's results and of their squares: equal where the results are, bit for bit (the same
    reductions of the same values)."""
    sums = [torch.stack([t.sum(), _dot(t)]).float() for t in results if t is not None]
    return torch.cat(sums) if sums else torch.zeros(0)


def _dot(t: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``t``'s elements, in its precision (half precision's in float32): one pass of a dot
    product, no squared copy, no float64 copy (double sums of a large gradient are slow on a CPU)."""
    flat = t.reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return torch.dot(flat, flat)


def _each(tensors) -> tuple:
    """A backward call's ``tensors`` as a tuple (one tensor, or a sequence of tensors or gradient edges)."""
    return (tensors,) if isinstance(tensors, (torch.Tensor, GradientEdge)) else tuple(tensors)


def _node(root):
    """The node a backward call starts from at ``root`` (a tensor's ``grad_fn``, a gradient edge's node)."""
    return root.node if isinstance(root, GradientEdge) else root.grad_fn


def _copied(results: tuple) -> tuple:
    """A node's call's results, copied: its next call may write over the buffers it handed back."""
    return tuple(None if t is None else t.clone() for t in results)


def _outputs(out) -> tuple:
    """A node's call's gradients as a tuple (a node of one input returns its tensor)."""
    return out if isinstance(out, tuple) else (out,)
