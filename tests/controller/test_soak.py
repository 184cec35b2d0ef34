"""2,000 steps with an adaptation every 100: nothing the controller holds, and no Python object count, grows."""

import gc

import torch
import torch.nn.functional as F
from torch import nn

import gactx


def test_two_thousand_steps_with_adaptation_every_hundred():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    controller = gactx.Controller(model, level="L2.2", adapt_interval=100, adapt_backoff=1)  # a fixed interval
    sizes = {}

    def held():
        # (the pass's tables of live storages and of stored handles are rebuilt every pass; they are bounded by the
        # pass's records: a dead handle's entry stays until the pass ends, so their sizes vary with addresses)
        sizes = controller.diagnostics()
        assert sizes["storages"] <= len(controller.records) and sizes["handles"] <= len(controller.records)
        return sizes["keys"], len(controller.records), len(controller.allocation), len(controller.sensitivity)

    with controller:
        for step in range(1, 2001):
            loss = F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            controller.iterate(lambda: F.cross_entropy(model(x[:16]), y[:16]).backward())
            del loss
            if step in (200, 2000):
                gc.collect()
                sizes[step] = (held(), len(gc.get_objects()))
    assert controller.last_adaptation.step == 2000 and controller.step == 2000
    assert sizes[2000][0] == sizes[200][0], "the controller's tables grew"
    assert sizes[2000][1] <= sizes[200][1] + 50, f"live Python objects grew: {sizes[200][1]} -> {sizes[2000][1]}"
