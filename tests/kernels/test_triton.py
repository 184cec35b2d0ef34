"""gactx/kernels/_triton.py: whether Triton's interpreter takes minima and maxima as compiled kernels do, and the
refusal where it does not (its launch: test_launch.py)."""

import re

import pytest
import torch

import gactx
from gactx.kernels import _triton
from tests.conftest import INTERPRET, INTERPRETER_REPAIRED

interpreted = pytest.mark.skipif(not INTERPRET, reason="Triton runs on CPU tensors only with TRITON_INTERPRET=1")


@interpreted
def test_the_interpreter_skips_nan_in_minimum_and_maximum():
    """What the kernels rely on (here after tests/conftest.py's repair, where Triton's interpreter needs it): a group
    of one element holds it as its minimum, with no step, and gives it back."""
    assert _triton.interpreter_skips_nan()
    q = gactx.quantize(torch.tensor([3.5]), 4, 32, stochastic=False, backend="triton")
    assert q.meta.tolist() == [[3.5, 0.0]]
    assert gactx.dequantize(q, backend="triton").tolist() == [3.5]


@interpreted
def test_an_interpreter_that_propagates_nan_is_refused(monkeypatch):
    monkeypatch.setattr(_triton, "interpreter_skips_nan", lambda: False)
    message = rf"Triton {re.escape(_triton.triton.__version__)} propagates NaN.*docs/install\.md#triton-versions"
    with pytest.raises(RuntimeError, match=message):
        gactx.quantize(torch.ones(4), 4, backend="triton")
    assert gactx.quantize(torch.ones(4), 4, backend="torch").meta.tolist() == [[1.0, 0.0]]


@interpreted
def test_the_suite_repairs_the_interpreters_before_triton_3_8_only():
    """The interpreters of Triton 3.5.1, 3.6.0 and 3.7.1 propagate NaN (numpy's ``minimum``), 3.8's and 3.9's skip it
    (``fmin``): a repair under those would hide a regression of their interpreter."""
    version = tuple(int(part) for part in _triton.triton.__version__.split(".")[:2])
    known = {(3, 5): True, (3, 6): True, (3, 7): True, (3, 8): False, (3, 9): False}
    if version not in known:
        pytest.skip(f"Triton {_triton.triton.__version__}: whether its interpreter needs the repair is not recorded")
    assert INTERPRETER_REPAIRED == known[version]
