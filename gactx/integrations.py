"""gactx in training frameworks: a Hugging Face ``TrainerCallback``.

    from gactx.integrations import GactxCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GactxCallback(level="L1")])

The callback installs a :class:`gactx.Controller` on the model when training begins, counts steps, and
removes the hooks when training ends. At the adaptive levels it needs ``probe_batch``: a small batch (a
dict of tensors, as the model takes them, labels included) for the sensitivity estimator.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gactx.controller import Controller

__all__ = ["GactxCallback"]

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is optional
    TrainerCallback = object


class GactxCallback(TrainerCallback):
    """Compress the activations of a Hugging Face ``Trainer``'s model.

    Args:
        level: a gactx level (``"L1"``, ``"L2.2"``, ...); ``None`` for the global default.
        probe_batch: adaptive levels: a few samples as the model's keyword arguments, labels included.
        **options: :class:`gactx.Config` options.
    """

    def __init__(self, level: str | None = None, probe_batch: Mapping[str, torch.Tensor] | None = None, **options):
        if TrainerCallback is object:
            raise ImportError("GactxCallback needs the transformers package")
        self.level, self.options, self.probe_batch = level, options, probe_batch
        self.controller: Controller | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.controller = Controller(model, level=self.level, **self.options)
        if self.controller.config.adaptive and self.probe_batch is None:
            raise ValueError(f"level {self.controller.config.level} adapts bits: give GactxCallback a probe_batch")
        self.controller.install_hook()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.controller is None:
            return
        backprop = None
        if self.probe_batch is not None:
            device = next(model.parameters()).device
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.probe_batch.items()}
            backprop = lambda: model(**batch).loss.backward()  # noqa: E731
        self.controller.iterate(backprop)

    def on_train_end(self, args, state, control, **kwargs):
        if self.controller is not None and self.controller.installed:
            self.controller.uninstall_hook()
