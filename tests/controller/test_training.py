"""Training for real: the fixed and adaptive levels reach full-precision accuracy and loss."""

import pytest

from benchmarks.charlm import train_charlm
from benchmarks.digits import train_digits


@pytest.fixture(scope="module")
def digits_full():
    return train_digits(None)


@pytest.mark.parametrize("level", ["L1", "L2.2"])
def test_digits_cnn_matches_full_precision_accuracy(digits_full, level):
    full, compressed = digits_full, train_digits(level)
    assert full.accuracy >= 0.97, f"the baseline itself did not train ({full.accuracy:.3f})"
    assert compressed.accuracy >= full.accuracy - 0.01, f"{level} {compressed.accuracy:.4f}, full {full.accuracy:.4f}"
    assert compressed.memory.original_bytes == full.memory.original_bytes
    assert compressed.memory.packed_bytes * 4 < full.memory.packed_bytes  # >= 4.1x: MaxPool indices stay int64


def test_char_transformer_at_l2_2_is_within_3_percent_of_full_precision_loss():
    full, adaptive = train_charlm(None), train_charlm("L2.2")
    assert full.final_loss < 2.5, f"the baseline itself did not train ({full.final_loss:.3f})"
    assert adaptive.final_loss <= 1.03 * full.final_loss, (adaptive.final_loss, full.final_loss)
    assert adaptive.controller.last_adaptation is not None
    assert adaptive.memory.ratio > 6
