"""FSDP2 (fully_shard) with two gloo processes on the CPU: all-gathered weights are never compressed, and
training under gactx at L0 is the same as without it; at 8 bits it stays close."""

import json

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.controller.test_ddp import STEPS, _data, _model

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)


def _train_sharded(x, y, level):
    import gactx

    model = _model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
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
            kept_weights &= not any(r.key.shape in weight_shapes for r in controller._pass.records)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return full, kept_weights


def _worker(rank: int, world: int, folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        x, y = _data()
        half = slice(rank * 32, rank * 32 + 32)
        x, y = x[:, half], y[:, half]
        plain, _ = _train_sharded(x, y, None)
        l0, _ = _train_sharded(x, y, "L0")
        l8, kept = _train_sharded(x, y, "L1.1")
        result = {
            "l0_equal": all(torch.equal(a, b) for a, b in zip(plain, l0, strict=True)),
            "l8_cos": float(F.cosine_similarity(torch.cat([p.flatten() for p in plain]) - torch.cat(
                [p.flatten() for p in _model().parameters()]), torch.cat([p.flatten() for p in l8]) - torch.cat(
                [p.flatten() for p in _model().parameters()]), dim=0)),
            "weights_kept": kept,
        }  # fmt: skip
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_gloo_processes(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["l0_equal"], "gactx at L0 changed FSDP2 training"
        assert r["weights_kept"], "an all-gathered weight was compressed"
        assert r["l8_cos"] > 0.99, r
