"""gactx in training frameworks: a Hugging Face ``TrainerCallback`` and a PyTorch Lightning ``Callback``.

    from gactx.integrations import GactxCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GactxCallback(level="L1")])

    from gactx.integrations import GactxLightningCallback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[GactxLightningCallback(level="L1")])

Each installs a :class:`gactx.Controller` on the model when training begins, calls ``iterate`` after each
step, and removes the hooks when training ends. At the adaptive levels each needs ``probe_batch``: a small
batch for the sensitivity estimator (Hugging Face: a dict of tensors as the model takes them, labels
included; Lightning: a batch as ``training_step`` takes it). ``GactxLightningCallback`` is built on first
access, so importing this module does not import Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gactx.controller import Controller

__all__ = ["GactxCallback", "GactxLightningCallback"]  # noqa: F822 (the second is built by __getattr__)

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is optional
    TrainerCallback = object


def _controller(callback, model) -> Controller:
    """A controller for ``model`` at ``callback``'s level and options (not yet installed)."""
    controller = Controller(model, level=callback.level, **callback.options)
    if controller.config.adaptive and callback.probe_batch is None:
        raise ValueError(f"level {controller.config.level} adapts bits: give {type(callback).__name__} a probe_batch")
    return controller


def _stop(controller: Controller | None) -> None:
    if controller is not None and controller.installed:
        controller.uninstall_hook()


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
        self.controller = _controller(self, model).install_hook()

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
        _stop(self.controller)


def _lightning_callback_class() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as err:
            raise ImportError("GactxLightningCallback needs the lightning (or pytorch_lightning) package") from err

    class GactxLightningCallback(Callback):
        """Compress the activations of a PyTorch Lightning ``LightningModule`` during ``fit``.

        Args:
            level: a gactx level (``"L1"``, ``"L2.2"``, ...); ``None`` for the global default.
            probe_batch: adaptive levels: a few samples, as ``training_step`` takes a batch (on any device:
                moved to the module's).
            **options: :class:`gactx.Config` options.
        """

        def __init__(self, level: str | None = None, probe_batch=None, **options) -> None:
            super().__init__()
            self.level, self.options, self.probe_batch = level, options, probe_batch
            self.controller: Controller | None = None
            self._resume: dict | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.controller = _controller(self, pl_module)
            if self._resume is not None:  # fit(ckpt_path=...) restored callbacks before training starts
                self.controller.load_state_dict(self._resume)
            self.controller.install_hook()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.controller is None:
                return
            backprop = None
            if self.probe_batch is not None:
                probe = pl_module.transfer_batch_to_device(self.probe_batch, pl_module.device, 0)

                def backprop():
                    out = pl_module.training_step(probe, 0)
                    (out["loss"] if isinstance(out, Mapping) else out).backward()

            self.controller.iterate(backprop)

        def on_train_end(self, trainer, pl_module) -> None:
            _stop(self.controller)

        def state_dict(self) -> dict:
            """The controller's state (step, sensitivities, bits), saved in Lightning's checkpoints."""
            return {} if self.controller is None else self.controller.state_dict()

        def load_state_dict(self, state_dict: dict) -> None:
            self._resume = state_dict or None

    return GactxLightningCallback


def __getattr__(name: str):
    if name == "GactxLightningCallback":
        cls = globals()[name] = _lightning_callback_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
