"""gactx/kernels/bitmask.py: 1-bit packing of bool masks, lossless, identical in Triton and torch."""

import numpy as np
import pytest
import torch

from gactx.kernels.bitmask import torch_pack_bool, torch_unpack_bool, triton_pack_bool, triton_unpack_bool
from tests.conftest import TRITON_DEVICE


def _mask(n: int, device: str) -> torch.Tensor:
    return (torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3).to(device)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 257, 4099, 70001])
def test_pack_matches_numpy_and_round_trips(triton_device, n):
    mask = _mask(n, triton_device)
    interpret = triton_device == "cpu"
    expected = np.packbits(mask.cpu().numpy(), bitorder="little")  # independent oracle of the layout
    for packed in (torch_pack_bool(mask), triton_pack_bool(mask, interpret)):
        assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
        assert np.array_equal(packed.cpu().numpy(), expected)
    packed = torch_pack_bool(mask)
    assert torch.equal(torch_unpack_bool(packed, n), mask)
    assert torch.equal(triton_unpack_bool(packed, n, interpret), mask)


def test_gpu_launch_configuration_across_programs_and_tail():
    n = 2 * 2048 * 8 + 77  # two whole programs of the GPU's launch, then a masked one
    mask = _mask(n, TRITON_DEVICE)
    expected = np.packbits(mask.cpu().numpy(), bitorder="little")
    packed = triton_pack_bool(mask, interpret=False)
    assert np.array_equal(packed.cpu().numpy(), expected)
    assert torch.equal(triton_unpack_bool(packed, n, interpret=False), mask)
