"""Assertions shared by the kernel tests."""

import torch


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


def group_steps(meta: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    """Each element's quantization step, from a per-group ``(lo, step)`` table."""
    return meta[:, 1].repeat_interleave(group_size)[:numel]


def live(kind: type) -> list:
    """Objects of ``kind`` the garbage collector tracks. ``type(o)`` is used, not ``isinstance``: a dead
    ``weakref.proxy`` left by another test raises ``ReferenceError`` when ``isinstance`` asks its class."""
    import gc

    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), kind)]
