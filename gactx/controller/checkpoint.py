"""Non-reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``, and Hugging Face's
``gradient_checkpointing_enable()``, which uses it) with gactx installed.

Such a checkpoint keeps two things between forward and backward:

- **the regions' inputs** (the hidden states at each layer boundary). torch saves them with
  ``_make_saved_tensor``, which goes through the saved-tensor hooks in scope, so gactx's pack hook sees them; they
  are stored under their own rule (``rules.CHECKPOINT_INPUT``) at the level's ``checkpoint_bits``, and backward
  recomputes each region from its decoded input;
- **what a region's recomputation saves** in backward, until the region's backward has used it: a whole region's
  activations at once, which is where a checkpointed step peaks. torch keeps them in its frame's dictionary
  ``recomputed``, beside the hooks; while gactx's hooks are the ones in scope when a region begins, that dictionary
  is :class:`Recomputed`, which stores each tensor through gactx's pack hook and decodes it when backward asks for
  it. Saves made in backward are counted apart (``Controller.memory_stats(backward=True)``).

Both go through two of torch's classes, ``torch.utils.checkpoint._CheckpointFrame`` and ``_recomputation_hook``:
while a :class:`gactx.Controller` is installed they are replaced by :class:`Frame` and :class:`Recomputation`,
subclasses that behave as torch's wherever gactx's hooks are not the ones in scope as a region begins; the last
controller to uninstall puts torch's classes back. A torch without that class (it is
private) checkpoints as before: its regions' inputs still reach the hooks, their recomputed tensors are kept as
they are (:func:`supported` says which). A torch whose frame has no ``save_inputs`` (it saved the inputs through a
custom autograd function before 2.13) stores them as the saves of an op it learns, not as checkpoint inputs.

Reentrant checkpointing (``use_reentrant=True``) needs none of this: its inputs are a custom autograd function's
saved tensors and its recomputation an ordinary forward in backward, both under gactx's hooks.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from functools import partial

import torch
import torch.utils.checkpoint as _ckpt
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes

__all__ = ["Frame", "Recomputation", "Recomputed", "SAVING", "install", "supported", "uninstall"]

_TORCH_FRAME = getattr(_ckpt, "_CheckpointFrame", None)
_TORCH_RECOMPUTATION = getattr(_ckpt, "_recomputation_hook", None)
_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class _Saving(threading.local):
    """Per thread: whether the save under way is a checkpointed region's input (read for every save: the class
    default makes it an attribute read, where a thread that never set it would raise inside ``getattr``)."""

    inputs = False


SAVING = _Saving()
_lock = threading.Lock()
_installed = 0


def supported() -> bool:
    """Whether this torch's non-reentrant checkpoint can be followed (its frame class and the hooks in scope)."""
    return _top is not None and isinstance(_TORCH_FRAME, type) and isinstance(_TORCH_RECOMPUTATION, type)


class Recomputed(weakref.WeakKeyDictionary):
    """torch's dictionary of one backward's recomputed tensors (handle -> tensor), holding each through gactx's
    ``pack`` hook and decoding it with ``unpack`` when read (torch reads each once, then drops its handle)."""

    def __init__(self, pack, unpack) -> None:
        super().__init__()
        self._pack, self._unpack = pack, unpack
        # While Recomputation's pack hook runs (``handing``), what the tensor was stored as: the hook hands it on to
        # the recomputation's graph and clears it. Nothing else keeps it: the dictionary holds it until read.
        self.handing, self.last = False, None

    def __setitem__(self, key, value) -> None:
        if isinstance(value, torch.Tensor):
            # Outside the recomputation's dispatch modes: a selective checkpointing policy replays the region's ops
            # in order, and the compression's own ops are none of them.
            with _no_dispatch_modes():
                value = self._pack(value)
            if self.handing:
                self.last = value
        super().__setitem__(key, value)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return value if isinstance(value, torch.Tensor) else self._unpack(value)


if supported():

    class Frame(_TORCH_FRAME):
        """torch's checkpoint frame, gactx's where gactx's hooks are in scope as a region begins: its inputs are
        saved as such (:data:`SAVING`), its recomputed tensors held compressed (:class:`Recomputed`)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            hooks = _top(False)  # the hooks in scope as the region begins (None: none)
            self.gactx = hooks is not None and getattr(hooks[0], "gactx_hooks", False)
            if self.gactx:
                self.recomputed = defaultdict(partial(Recomputed, *hooks))

        if hasattr(_TORCH_FRAME, "save_inputs"):  # torch 2.13's; before, an autograd function saved the inputs

            def save_inputs(self, *args) -> None:
                if not self.gactx:
                    return super().save_inputs(*args)
                outer, SAVING.inputs = SAVING.inputs, True
                try:
                    return super().save_inputs(*args)
                finally:
                    SAVING.inputs = outer

    class Recomputation(_TORCH_RECOMPUTATION):
        """torch's saved-tensor hooks of a region's recomputation. torch's pack hook puts each recomputed tensor in
        the frame's dictionary and returns the tensor itself to the recomputation's own graph, which holds it until
        the recomputation returns: a whole region at full width, beside what the dictionary holds. Under a gactx
        frame the graph gets what the dictionary stored instead (decoded, should anything backward through it)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # torch 2.13's arguments: (target_frame_ref, gid). Another torch's that do not read so: torch's own hooks.
            target_frame_ref = args[0] if args else kwargs.get("target_frame_ref")
            gid = args[1] if len(args) > 1 else kwargs.get("gid")
            frame = target_frame_ref() if isinstance(target_frame_ref, weakref.ref) else None
            if frame is None or not getattr(frame, "gactx", False):
                return
            store, torch_pack = frame.recomputed[gid], self.pack_hook

            def pack_hook(x):
                store.handing, store.last = True, None
                try:
                    held = torch_pack(x)  # stored compressed by Recomputed (raises to stop early once all are)
                finally:  # held by the dictionary and the graph, not by the store: the last one too, where it raised
                    stored, store.handing, store.last = store.last, False, None
                return held if stored is None else stored

            def unpack_hook(held):
                return held if isinstance(held, torch.Tensor) else store._unpack(held)

            self.pack_hook, self.unpack_hook = pack_hook, unpack_hook

else:  # pragma: no cover - a torch without the class
    Frame = Recomputation = None


def install() -> None:
    """A controller installs its hooks: torch's frame class becomes :class:`Frame` (counted: once for all)."""
    global _installed
    with _lock:
        _installed += 1
        if _installed == 1 and supported():
            _ckpt._CheckpointFrame, _ckpt._recomputation_hook = Frame, Recomputation


def uninstall() -> None:
    """A controller removes its hooks: the last one puts torch's frame class back."""
    global _installed
    with _lock:
        _installed = max(0, _installed - 1)
        if _installed == 0 and supported():
            if _ckpt._CheckpointFrame is Frame:
                _ckpt._CheckpointFrame = _TORCH_FRAME
            if _ckpt._recomputation_hook is Recomputation:
                _ckpt._recomputation_hook = _TORCH_RECOMPUTATION
