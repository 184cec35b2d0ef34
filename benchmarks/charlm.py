"""A small character-level transformer trained on text every Python installation has: its standard library.

Nothing is downloaded: the corpus is the concatenated sources of a fixed list of standard-library modules,
read as bytes (vocabulary 256).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import gactx

# Modules that exist in every CPython since 3.10, in a fixed order: the same corpus on every machine.
CORPUS_MODULES = ("argparse", "textwrap", "heapq", "bisect", "fractions", "functools", "string", "shlex")


def corpus(max_bytes: int = 400_000) -> torch.Tensor:
    lib = os.path.dirname(os.__file__)
    text = b"".join(open(os.path.join(lib, f"{name}.py"), "rb").read() for name in CORPUS_MODULES)
    return torch.frombuffer(bytearray(text[:max_bytes]), dtype=torch.uint8).long()


class CharLM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=dropout, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(h)


def batch(data: torch.Tensor, size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, data.numel() - context - 1, (size,), generator=generator)
    window = torch.stack([data[s : s + context + 1] for s in start.tolist()])
    return window[:, :-1], window[:, 1:]


def lm_loss(model: CharLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


@dataclass
class CharLMRun:
    level: str | None
    losses: list[float]
    seconds: float
    memory: gactx.MemoryStats
    controller: gactx.Controller
    closure: Callable[[], object]  # what iterate was given: the estimator's closure over 8 sequences

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 20 steps."""
        tail = self.losses[-20:]
        return sum(tail) / len(tail)


def train_charlm(
    level: str | None, steps: int = 150, batch_size: int = 32, context: int = 64, seed: int = 0, **options
) -> CharLMRun:
    """Train from the same initialisation and batches at ``level`` (``None``: counted by L0, not compressed).
    At adaptive levels a closure over 8 sequences is handed to ``iterate``."""
    data = corpus()
    torch.manual_seed(seed)
    model = CharLM(context=context)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    probe_x, probe_y = batch(data, 8, context, torch.Generator().manual_seed(seed + 1))
    controller = gactx.Controller(model, level=level or "L0", **options).install_hook()
    losses = []

    def closure() -> None:
        lm_loss(model, probe_x, probe_y).backward()

    start = time.perf_counter()
    try:
        for _ in range(steps):
            x, y = batch(data, batch_size, context, gen)
            loss = lm_loss(model, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            controller.iterate(closure)
    finally:
        controller.uninstall_hook()
    return CharLMRun(level, losses, time.perf_counter() - start, controller.memory_stats(), controller, closure)
