"""A small CNN on scikit-learn's digits (1,797 8x8 images that ship with the package): a real training run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import gactx


def digits_data(seed: int = 0):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.7 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 16, 10),
    )  # fmt: skip


@dataclass
class DigitsRun:
    level: str | None
    accuracy: float
    loss: float
    seconds: float
    steps: int
    memory: gactx.MemoryStats  # saved activations of the last step (level L0 when run without compression)
    controller: gactx.Controller
    closure: Callable[[], object]  # what iterate was given: the estimator's closure over 16 training images


def train_digits(level: str | None, epochs: int = 8, batch: int = 64, seed: int = 0) -> DigitsRun:
    """Train from the same initialisation and batch order, compressed at ``level`` or not at all (``None``;
    activations are then counted, not compressed, by level L0). At adaptive levels ``iterate`` gets a
    closure over 16 training images for the sensitivity estimator."""
    (xtr, ytr), (xte, yte) = digits_data()
    torch.manual_seed(seed)
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    controller = gactx.Controller(model, level=level or "L0").install_hook()

    def closure() -> None:
        F.cross_entropy(model(xtr[:16]), ytr[:16]).backward()

    start = time.perf_counter()
    try:
        for epoch in range(epochs):
            order = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(seed * 100 + epoch))
            for i in range(0, len(ytr), batch):
                idx = order[i : i + batch]
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                controller.iterate(closure)
    finally:
        controller.uninstall_hook()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    return DigitsRun(
        level, accuracy, loss.item(), seconds, controller.step, controller.memory_stats(), controller, closure
    )
