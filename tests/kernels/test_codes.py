"""Codes with a table: lossless round trips at every width, layouts kept, bytes as the formula says."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gactx.kernels.codes import coded_nbytes, decode_codes, encode_codes


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 255, 257, 4099])
def test_round_trip_is_the_table_lookup(bits, n, device):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 1 << bits, (n,), generator=g).to(device)
    table = torch.randn(1 << bits, generator=g).to(device)
    ct = encode_codes(codes.bool() if bits == 1 else codes, bits, table)
    out = decode_codes(ct)
    assert out.device == codes.device and out.dtype == table.dtype
    assert torch.equal(out, table[codes.long()])
    assert ct.nbytes == coded_nbytes(n, bits, table.dtype)


@pytest.mark.parametrize("bits", [1, 4])
def test_codes_come_back_in_their_layout(bits):
    x = torch.randn(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)
    codes = (x > 0) if bits == 1 else torch.bucketize(x, torch.linspace(-1, 1, 15))
    table = torch.arange(1 << bits, dtype=torch.bfloat16)
    out = decode_codes(encode_codes(codes, bits, table))
    assert out.stride() == codes.stride()
    assert torch.equal(out, table[codes.long()])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.sampled_from([2, 4, 8]), st.integers(0, 2**31))
def test_any_codes_decode_to_their_values(n, bits, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int32)
    table = torch.randn(1 << bits, generator=g, dtype=torch.float64).float()
    assert torch.equal(decode_codes(encode_codes(codes, bits, table)), table[codes.long()])


def test_bad_widths_and_tables_are_refused():
    with pytest.raises(ValueError, match="bits=3"):
        encode_codes(torch.zeros(4, dtype=torch.int32), 3, torch.zeros(8))
    with pytest.raises(ValueError, match="table of 4 values"):
        encode_codes(torch.zeros(4, dtype=torch.int32), 2, torch.zeros(3))
