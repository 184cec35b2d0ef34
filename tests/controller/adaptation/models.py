"""Models the adaptation tests share."""

import torch
from torch import nn


def scaled_mlp() -> tuple[nn.Module, torch.Tensor]:
    """Layers whose inputs differ in scale by orders of magnitude: their sensitivities do too."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4)
    )  # fmt: skip
    with torch.no_grad():
        for i, scale in zip((2, 4, 6), (0.01, 1.0, 30.0), strict=True):
            model[i].weight.mul_(scale)
    return model, torch.randn(64, 64) * 3
