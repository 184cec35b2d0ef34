"""gactx/kernels/_grid.py: launches cover every element once, whole programs unmasked."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gactx.kernels._grid import launches


@given(n=st.integers(0, 10**7), block=st.sampled_from([32, 4096, 8192, 1 << 16]), split=st.sampled_from([1, 2, 4]))
def test_launches_cover_each_element_once_and_mask_only_the_end(n, block, split):
    tail_block = max(1, block // split)
    covered = []  # (start, end, masked) of each program, launch by launch
    for programs, first, masked in launches(n, block, tail_block):
        assert programs >= 1
        size = tail_block if masked else block
        covered += [(p * size, (p + 1) * size, masked) for p in range(first, first + programs)]
    starts = [start for start, _, _ in covered]
    assert starts == [0, *(end for _, end, _ in covered[:-1])][: len(covered)], "a gap or an overlap between programs"
    assert not covered or (covered[-1][0] < n <= covered[-1][1]), "the last program holds the last element"
    unmasked = [end for _, end, masked in covered if not masked]
    assert all(end <= n for end in unmasked), "an unmasked program reaches past the end"
    assert all(masked for _, _, masked in covered[len(unmasked) :]), "masked programs come last"


@pytest.mark.parametrize(
    ("n", "expected"),
    [(0, []), (5, [(1, 0, True)]), (8192, [(1, 0, False)]), (3 * 8192 + 2049, [(3, 0, False), (2, 12, True)])],
)
def test_launches_examples(n, expected):
    assert launches(n, 8192, 2048) == expected
