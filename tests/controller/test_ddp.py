"""DistributedDataParallel with two gloo processes on the CPU: gactx at L0 changes nothing, and at an
adaptive level every rank compresses with the same bits."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import on_two_ranks

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 64, 32, generator=gen), torch.randint(0, 4, (STEPS, 64), generator=gen)


def _train(model, x, y, controller=None, probe=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        if controller is not None:
            controller.install_hook()
        loss = F.cross_entropy(model(x[step]), y[step])
        if controller is not None:
            controller.uninstall_hook()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if controller is not None:
            controller.iterate(probe)
    return [p.detach().clone() for p in model.parameters()]


def _rank_data(rank: int):
    """Each of two ranks trains its half of every batch."""
    x, y = _data()
    half = slice(rank * 32, rank * 32 + 32)
    return x[:, half], y[:, half]


def _worker(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gactx

    x, y = _rank_data(rank)
    plain = _train(DDP(_model()), x, y)
    with_l0 = _train(DDP(ddp_l0 := _model()), x, y, gactx.Controller(ddp_l0, level="L0"))
    model = DDP(_model())
    controller = gactx.Controller(model, level="L2.2")
    _train(model, x, y, controller, lambda: F.cross_entropy(model(x[0, :8]), y[0, :8]).backward())
    return {
        "plain": [p.tolist() for p in plain],
        "l0_equal": all(torch.equal(a, b) for a, b in zip(plain, with_l0, strict=True)),
        "bits": sorted((repr(k), v) for k, v in controller.allocation.items()),
        "compressed": controller.memory_stats().compressed,
    }


def test_ddp_two_gloo_processes(tmp_path):
    r0, r1 = on_two_ranks(_worker, tmp_path)
    assert r0["l0_equal"] and r1["l0_equal"], "gactx at L0 changed DDP training"
    single = _train(_model(), *_data())  # one process, whole batches: the same training up to summation order
    for p, q in zip(single, r0["plain"], strict=True):
        assert torch.allclose(p, torch.tensor(q), rtol=1e-5, atol=1e-6)
    assert r0["bits"] == r1["bits"] and len(r0["bits"]) >= 3 and r0["compressed"] >= 3
