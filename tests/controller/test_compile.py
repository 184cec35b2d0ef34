"""torch.compile: a compiled model under the controller trains correctly and gactx breaks no graph."""

import torch
import torch.nn.functional as F
from torch import nn

import gactx


def test_compiled_model_under_the_controller():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    compiled = torch.compile(model)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))

    def grads(module, controller=None):
        model.zero_grad(set_to_none=True)
        if controller is None:
            loss = F.cross_entropy(module(x), y)
        else:
            with controller:
                loss = F.cross_entropy(module(x), y)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    eager, plain_compiled = grads(model), grads(compiled)
    l0 = gactx.Controller(model, level="L0")
    assert torch.equal(grads(compiled, l0), plain_compiled), "L0 must not change the compiled model's gradients"
    assert torch.allclose(plain_compiled, eager, rtol=1e-4, atol=1e-6)
    assert l0.memory_stats().original_bytes > 0
    l8 = gactx.Controller(model, level="L1.1")
    assert F.cosine_similarity(grads(compiled, l8), eager, dim=0) >= 0.995
    assert l8.memory_stats().compressed >= 3, "what the compiled graph saves is compressed"
    assert not counters["graph_break"], f"gactx broke the graph: {dict(counters['graph_break'])}"
