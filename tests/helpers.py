"""Helpers shared by the tests: bit-level assertions, live-object counts, two-rank runs."""

import torch


def special_input(n: int, dtype: torch.dtype, seed: int, scale: float = 1.0, specials=(), every: int = 97):
    """``n`` normal values times ``scale`` in ``dtype``, with ``specials`` (NaN, infinities, ...) put every
    ``every`` elements from the first."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    for i, v in zip(range(0, n, every), specials, strict=False):
        x[i] = v
    return x.to(dtype)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` as an integer tensor of the same element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical, except that any NaN equals any NaN (NaN payloads carry no meaning)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype.is_floating_point:
        nan_a, nan_b = a.isnan(), b.isnan()
        assert torch.equal(nan_a, nan_b), "NaN at different places"
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    mismatch = (bits_view(a) != bits_view(b)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[:5].flatten().tolist()}"


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (0.0 equals -0.0), NaN where the other has NaN (the payload of a NaN cast to bf16 is the
    kernel's)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def group_steps(meta: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    """Each element's quantization step, from a per-group ``(lo, step)`` table."""
    return meta[:, 1].repeat_interleave(group_size)[:numel]


def live(kind: type) -> list:
    """Objects of ``kind`` the garbage collector tracks. ``type(o)`` is used, not ``isinstance``: a dead
    ``weakref.proxy`` left by another test raises ``ReferenceError`` when ``isinstance`` asks its class."""
    import gc

    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), kind)]


def on_two_ranks(worker, folder) -> list[dict]:
    """Run ``worker(rank)`` in two gloo processes on the CPU; return what each rank's call returned (JSON)."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, str(folder), worker), nprocs=2, join=True)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def _rank_main(rank: int, world: int, folder: str, worker) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        result = worker(rank)
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        # Both ranks are done before either tears gloo down: a rank that leaves while its peer still holds
        # a connection can take the peer down with it (std::terminate in a gloo thread, seen under load).
        dist.barrier()
    finally:
        dist.destroy_process_group()
