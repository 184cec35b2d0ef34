"""FSDP2 (fully_shard) with two gloo processes on the CPU: all-gathered weights are never compressed, and
training under gactx at L0 is the same as without it; at 8 bits it stays close."""

import pytest
import torch
import torch.nn.functional as F

from tests.controller.test_ddp import STEPS, _model, _rank_data
from tests.helpers import on_two_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)


def _train_sharded(x, y, level):
    from torch.distributed.device_mesh import init_device_mesh

    import gactx

    # On the CPU, named: FSDP2's default mesh is the GPU's where there is one.
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = _model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    controller = gactx.Controller(model, level=level) if level else None
    kept_weights = True
    for step in range(STEPS):
        if controller is not None:
            controller.install_hook()
        loss = F.cross_entropy(model(x[step]), y[step])
        if controller is not None:
            controller.uninstall_hook()
            weight_shapes = {(128, 32), (128, 128), (4, 128)}
            kept_weights &= not any(r.key.shape in weight_shapes for r in controller.records)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return full, kept_weights


def _worker(rank: int) -> dict:
    x, y = _rank_data(rank)
    plain, _ = _train_sharded(x, y, None)
    l0, _ = _train_sharded(x, y, "L0")
    l8, kept = _train_sharded(x, y, "L1.1")
    start = torch.cat([p.flatten() for p in _model().parameters()])

    def change(params):  # what training did to the parameters
        return torch.cat([p.flatten() for p in params]) - start

    return {
        "l0_equal": all(torch.equal(a, b) for a, b in zip(plain, l0, strict=True)),
        "l8_cos": float(F.cosine_similarity(change(plain), change(l8), dim=0)),
        "weights_kept": kept,
    }


def test_fsdp2_two_gloo_processes(tmp_path):
    for r in on_two_ranks(_worker, tmp_path):
        assert r["l0_equal"], "gactx at L0 changed FSDP2 training"
        assert r["weights_kept"], "an all-gathered weight was compressed"
        assert r["l8_cos"] > 0.99, r
