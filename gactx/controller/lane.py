"""The eager hooks' work with no Python frame of gactx's for most saves of a model on a CPU: the C++ lane.

Once a model's passes repeat, keys go by position (``identity.py``) and most saves take the pack path's lane,
:meth:`~gactx.controller.pack.PackPath._by_position`: the parameter test, the save at its position, the replayed
save's C++ packer, the record. Where a step is short, that lane's Python and the hooks' calls are a visible share of
the step (``python -m benchmarks.host`` measures it). ``csrc/lane.cpp`` does the same steps in C++,
reading and writing the same Python objects (the path's pass statistics, the tracker's position, the replays): a save
it cannot take whole (one whose storage an earlier save holds, one not replayed with a packer of its own, one not
contiguous, any save of a pass not by position, ...) goes to :meth:`PackPath.pack` from the start, as if the
lane were not there, and the lane changes nothing before it knows it takes a save. So records, keys, seeds and bytes are
the Python path's, bit for bit (``tests/controller/test_lane.py``).

The unpack hook's eager work (``store.unpack``) is a C function too: a tensor as it is, a ``store.Kept``'s tensor at
its version, else ``handle.unpack()``; and so is each hook's own call (``HookGraph.__call__``: traced, under
TorchDynamo, or eager), so that no Python frame of gactx's runs for a save the lane takes (``csrc/hooks.cpp``).

The lane is used where the C++ kernels serve the model (its parameters on a CPU, ``backend`` ``"auto"`` or
``"cpp"``, the extension built), or native launches do (its parameters on a GPU, ``backend`` ``"auto"`` or
``"triton"``, the extension built with the driver's launches: ``gactx.kernels.native``), on Python 3.11 or later (it
reads frames through ``PyFrame_GetLasti``); elsewhere, or with :data:`NATIVE` false, the hooks are the Python path's
own.
"""

from __future__ import annotations

import itertools
import sys

import torch

from gactx.controller.checkpoint import SAVING
from gactx.controller.compiled import CompiledPath, EagerHook, HookGraph, hook
from gactx.controller.pack import PackPath
from gactx.controller.policy import _VIEW_NODES
from gactx.controller.positions import _PASSING, PRECALL, PRECALL_TO_CALL
from gactx.controller.store import Kept, unpack
from gactx.kernels import cpu, native

__all__ = ["NATIVE", "PYTHON_HAS_LANE", "graph_hooks"]

NATIVE = True  # the C++ lane where it serves (False: the Python path's hooks alone, as a comparison runs them)
# The lane reads frames through PyFrame_GetLasti (Python 3.11 and later); before it the hooks are the Python path's.
PYTHON_HAS_LANE = sys.version_info >= (3, 11)


def graph_hooks(
    path: PackPath, compiled: CompiledPath, model: torch.nn.Module
) -> tuple[HookGraph | EagerHook, HookGraph | EagerHook]:
    """The controller's pack and unpack hooks for ``path`` (the model's) and ``compiled``: their eager work the C++
    lane and unpack, and their own calls C++ (``HookGraph.call_natively``), where the lane serves (the module
    docstring); else ``path.pack`` and ``store.unpack``, called from Python."""
    built = None
    if NATIVE and PYTHON_HAS_LANE and _served(model, path.config.backend):
        built = cpu.extension()
    if built is None:
        return hook(path.pack, compiled.pack), hook(unpack, compiled.unpack)
    site = (-1 if PRECALL is None else PRECALL, PRECALL_TO_CALL)  # positions.call_site's reading of an instruction
    eager = built.lane(path, path.tracker, Kept, SAVING, _VIEW_NODES, _PASSING, *site)
    hooks = hook(eager, compiled.pack), hook(built.unpack_hook(Kept), compiled.unpack)
    for each in hooks:
        each.call_natively(built)
    return hooks


def _served(model: torch.nn.Module, backend: str) -> bool:
    """Whether the lane's packers serve the model: the C++ kernels where its first parameter (or buffer) is on a CPU
    (a model with neither: where no GPU is there), native launches where it is on a GPU that they serve."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    on_cpu = not torch.cuda.is_available() if first is None else first.device.type == "cpu"
    if on_cpu:
        return backend in ("auto", "cpp")
    return first is not None and backend in ("auto", "triton") and not native.why_not(first)
