"""Mixed precision: bf16/fp16 activations are compressed, autocast weight copies are not, and an fp16
overflow stays visible to GradScaler through compression."""

import pytest
import torch
import torch.nn.functional as F

import gactx
from benchmarks.zoo import build
from tests.controller.test_zoo import grads


@pytest.mark.parametrize("name", ["mlp", "transformer_layer", "bert", "conv3d"])
def test_bf16_autocast_activations_are_compressed(name):
    model, run = build(name)

    def autocast_run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run().float()

    plain = grads(model, autocast_run)
    assert torch.equal(grads(model, autocast_run, gactx.Controller(model, level="L0")), plain)
    controller = gactx.Controller(model, level="L1.1")
    compressed = grads(model, autocast_run, controller)
    assert F.cosine_similarity(plain, compressed, dim=0) >= 0.99
    records = controller.records
    assert any(r.dtype == torch.bfloat16 and r.bits == 8 for r in records), "bf16 activations must be compressed"
    # (autocast copies of weights are kept: tests/controller/test_controller.py checks it with distinct shapes)


def test_fp16_grad_scaler_still_sees_an_overflow():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(128, 64), torch.randint(0, 4, (128,))
    controller = gactx.Controller(model, level="L1.2", min_numel=1)

    def step(inputs):
        with controller, torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(inputs).float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    step(x)
    assert scaler.get_scale() == 2.0**10
    assert any(r.dtype == torch.float16 and r.bits == 2 for r in controller.records)
    before = [p.detach().clone() for p in model.parameters()]
    huge = x.clone()
    huge[0, 0] = 1e6  # overflows fp16 in the first layer's output: an inf is saved and compressed
    step(huge)
    assert scaler.get_scale() == 2.0**9, "the scaler must see the overflow and skip the step"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
