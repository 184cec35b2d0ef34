"""Helpers shared by the tests: bit-level assertions, live-object counts, two-rank runs."""

import torch


def special_input(n: int, dtype: torch.dtype, seed: int, scale: float = 1.0, specials=(), every: int = 97):
    """``n`` normal values times ``scale`` in ``dtype``, with ``specials`` (NaN, infinities, ...) put every
    ``every`` elements from the first."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    for i, v in zip(range(0, n, every), specials, strict=False):
        x[i] = v
    return x.to(dtype)


def extreme_input(dtype: torch.dtype) -> torch.Tensor:
    """Groups of 32 finite values at the edges of ``dtype``'s range, of mixed signs: for float32 and bfloat16
    spans that overflow float32 (``-2e38`` and ``2e38``, +-the largest finite value, ends just far enough apart)
    and one that reaches FLT_MAX only with the step's margin; for float16 values up to +-65504. Each group also
    holds zero, small and random values between its ends."""
    top = torch.finfo(dtype).max
    if dtype == torch.float16:
        ends = [(top, -top), (top, 0.0), (-top, 65000.0), (top, -1.0), (65472.0, -65472.0), (top, -top)]
    else:
        ends = [
            (top, -top),  # twice the largest finite value
            (2e38, -2e38),
            (top, -(2.0**103)),  # just past FLT_MAX apart: the span rounds to inf
            (2.0**103, -top),
            (3e38, -1e38),
            (top - 1e38, -1e38),  # a span within the margin of FLT_MAX: the top level's product overflows
            (top, 0.0),
            (1e38, -top),
        ]
    g = torch.Generator().manual_seed(0)
    groups = []
    for hi, lo in ends:
        inside = torch.rand(32, generator=g, dtype=torch.float64) * (hi - lo) + lo
        inside[:6] = torch.tensor([hi, lo, 0.0, 1.0, -1e-3, hi], dtype=torch.float64)
        groups.append(inside.clamp(-top, top))
    return torch.cat(groups).to(dtype)


def assert_unbiased_at_the_edges(quantize, bits: int, seeds: int) -> None:
    """Stochastic rounding of the first two groups of :func:`extreme_input` (float32: spans of twice FLT_MAX
    and of 4e38) by ``quantize(x, bits, seed) -> (codes, meta)`` at group size 32: every decode finite and
    within a step, and the mean of ``seeds`` decodes within 5 standard errors of ``x`` (a draw's variance is at
    most step**2 / 4). The one exception, documented in schemes/uniform/format.py: at 1 bit such a group's step is
    FLT_MAX, and its elements above ``lo + FLT_MAX`` take the top code in every draw."""
    from gactx.kernels.schemes.uniform.reference import torch_dequantize

    flt_max = torch.finfo(torch.float32).max
    x = extreme_input(torch.float32)[:64]
    total = torch.zeros(64, dtype=torch.float64)
    for seed in range(seeds):
        codes, meta = quantize(x, bits, seed)
        codes, meta = codes.cpu(), meta.cpu()
        xhat = torch_dequantize(codes, meta, bits, 32, 64, torch.float32).double()
        step = group_steps(meta, 32, 64).double()
        assert torch.isfinite(xhat).all() and ((xhat - x.double()).abs() <= step * (1 + 1e-5)).all()
        total += xhat
    mean = total / seeds
    top = (meta[:, 0].repeat_interleave(32) + flt_max).double()  # lo + FLT_MAX, rounded as decoding rounds it
    past = (step == flt_max) & (x.double() > top)
    assert ((mean - x.double()).abs() <= 5 * step / 2 / seeds**0.5)[~past].all(), "biased"
    assert (mean == top)[past].all()
    assert past.any() == (bits == 1), "at 1 bit the first group has elements above lo + FLT_MAX"


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


def native_handles() -> int:
    """Replayed saves' C++ handles not yet freed (``csrc/saved.h``): objects the garbage collector does not track."""
    from gactx.kernels import cpu

    built = cpu.extension()
    return 0 if built is None else built.Saved.alive()


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


def gradient_error(model, run, controller, draws=8):
    """Mean squared distance to the full-precision gradient over ``draws`` noise draws (variance + bias^2)."""

    def grad(c):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # same dropout masks in every run
        if c is None:
            run().backward()
        else:
            with c:
                run().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()

    exact = grad(None)
    errors = []
    for draw in range(draws):
        controller.step = 10_000 + draw  # the noise seeds follow the step
        errors.append(float((grad(controller) - exact).square().sum()))
    return sum(errors) / draws
