"""gactx/integrations.py: the PyTorch Lightning callback on a small CNN and generated data."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning.pytorch")

from gactx.integrations import GactxLightningCallback  # noqa: E402

STEPS = 4


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data(n=128):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 1, 16, 16, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def _fit(callbacks, max_steps=STEPS, ckpt_path=None, tmp_path=None):
    model = Net()
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(_data(), batch_size=32), ckpt_path=ckpt_path)
    return model, trainer


def test_l0_trains_exactly_as_without_gactx():
    plain, _ = _fit([])
    callback = GactxLightningCallback(level="L0")
    with_l0, _ = _fit([callback])
    assert callback.controller.step == STEPS
    assert callback.controller.memory_stats().original_bytes > 0
    for a, b in zip(plain.parameters(), with_l0.parameters(), strict=True):
        assert torch.equal(a, b)


def test_compresses_and_removes_its_hooks():
    callback = GactxLightningCallback(level="L1")
    _fit([callback])
    controller = callback.controller
    assert controller.step == STEPS and not controller.installed
    assert controller.memory_stats().compressed >= 4 and controller.memory_stats().ratio > 3


def test_adaptive_level_adapts_and_resumes_from_a_checkpoint(tmp_path):
    probe = _data(8).tensors
    callback = GactxLightningCallback(level="L2.2", probe_batch=probe)
    _, trainer = _fit([callback], tmp_path=tmp_path)
    assert callback.controller.last_adaptation is not None and callback.controller.last_adaptation.step == 1
    state = callback.controller.state_dict()
    assert len(state["bits"]) >= 4 and len(state["sensitivity"]) == len(state["bits"])
    trainer.save_checkpoint(tmp_path / "last.ckpt")

    resumed = GactxLightningCallback(level="L2.2", probe_batch=probe)
    _fit([resumed], max_steps=STEPS + 2, ckpt_path=tmp_path / "last.ckpt", tmp_path=tmp_path)
    again = resumed.controller.state_dict()
    assert again["step"] == STEPS + 2 and resumed.controller.last_adaptation is None  # none due before 1000
    assert (again["bits"], again["sensitivity"]) == (state["bits"], state["sensitivity"])  # carried over


def test_adaptive_level_without_a_probe_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="give GactxLightningCallback a probe_batch"):
        _fit([GactxLightningCallback(level="L2.2")])
