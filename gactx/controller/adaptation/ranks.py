"""The ranks of ``torch.distributed`` that adapt side by side: whether there are several, the device their collectives
run on, and a mean over them (the estimators' groups, ``groups.py``, and the budget's averages, ``budget.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["collective_device", "distributed", "mean_over_ranks"]


def distributed() -> bool:
    """Whether more than one rank of ``torch.distributed`` runs."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """Where a collective's tensor must live: the current CUDA device under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` (on the host, float64) averaged over the ranks; ``t`` itself where one process runs."""
    if not distributed():
        return t
    out = t.to(device=collective_device(), dtype=torch.float64, copy=True)
    dist.all_reduce(out)
    return (out / dist.get_world_size()).cpu()
