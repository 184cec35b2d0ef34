"""gactx/kernels/format.py: byte counts, memory order, argument checks."""

import pytest
import torch

from gactx.kernels.format import ALLOWED_BITS, GROUP_SIZES, check_args, expected_nbytes, memory_order


def test_nbytes_formula():
    assert expected_nbytes(256, torch.float32, 2, 256) == 64 + 8
    assert expected_nbytes(257, torch.float32, 2, 256) == 128 + 16  # codes cover whole groups
    assert expected_nbytes(1, torch.float32, 1, 256) == 32 + 8
    assert expected_nbytes(0, torch.float32, 4, 256) == 0
    assert expected_nbytes(100, torch.float32, 16) == 200
    assert expected_nbytes(100, torch.bfloat16, 32) == 200
    assert expected_nbytes(9, torch.bool, 2) == 2


def test_default_compression_ratios_for_float32():
    n = 1 << 20
    assert expected_nbytes(n, torch.float32, 2) <= 4 * n / 14  # 14.2x: payload 2 bits + 0.25 bit metadata
    assert expected_nbytes(n, torch.float32, 4) <= 4 * n / 7  # 7.5x


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 4, 5),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
        lambda: torch.randn(6, 5).t(),
        lambda: torch.randn(4, 1, 5).transpose(0, 2),
    ],
)
def test_memory_order_is_a_view_for_dense_tensors(make):
    x = make()
    flat, dense_shape, perm = memory_order(x)
    assert flat.data_ptr() == x.data_ptr(), "a dense tensor must not be copied"
    assert torch.equal(flat.view(dense_shape), x if perm is None else x.permute(perm))


def test_memory_order_copies_tensors_with_gaps():
    x = torch.randn(8, 8)[:, ::2]
    flat, dense_shape, perm = memory_order(x)
    assert perm is None and torch.equal(flat.view(dense_shape), x)


def test_check_args_names_allowed_values():
    x = torch.randn(4)
    with pytest.raises(ValueError, match=r"allowed values are \(1, 2, 4, 8, 16, 32\)"):
        check_args(x, 3, 256)
    with pytest.raises(ValueError, match="group_size=100"):
        check_args(x, 2, 100)
    with pytest.raises(ValueError, match="allowed dtypes are torch.float32, torch.float16, torch.bfloat16, torch.bool"):
        check_args(x.double(), 2, 256)
    assert ALLOWED_BITS == (1, 2, 4, 8, 16, 32) and 256 in GROUP_SIZES
