"""Training for real: a CNN on scikit-learn's digits reaches full-precision accuracy at level L1."""

from benchmarks.digits import train_digits


def test_digits_cnn_at_l1_matches_full_precision_accuracy():
    full = train_digits(None)
    compressed = train_digits("L1")
    assert full.accuracy >= 0.97, f"the baseline itself did not train ({full.accuracy:.3f})"
    assert compressed.accuracy >= full.accuracy - 0.01, f"L1 {compressed.accuracy:.4f}, full {full.accuracy:.4f}"
    assert compressed.memory.original_bytes == full.memory.original_bytes
    assert compressed.memory.packed_bytes * 4 < full.memory.packed_bytes  # 4.1x: MaxPool indices stay int64
