"""Training for real: the fixed and adaptive levels reach full-precision accuracy and loss."""

import pytest

import gactx
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


def _train(name, method_name, steps, seed=0, held_out=None):
    """The models benchmark's training loop (its workload, Adam, batches) on the CPU: mean loss of the last
    three steps and held-out accuracy (``held_out`` samples; default the workload's batch)."""
    import torch

    from benchmarks import workloads
    from benchmarks.methods import Method
    from benchmarks.run import train_step

    torch.manual_seed(seed)  # dropout's masks: the same in every method's run
    w = workloads.build(name, "small", "cpu", seed=seed)
    method = Method(method_name, w, "fp32")
    optimizer = torch.optim.Adam(w.model.parameters(), lr=w.lr)
    gen = torch.Generator().manual_seed(seed)
    try:
        losses = [train_step(method, optimizer, *w.make_batch(w.default_batch, gen)) for _ in range(steps)]
    finally:
        method.close()
    held = w.make_batch(held_out or w.default_batch, torch.Generator().manual_seed(12345))
    return sum(losses[-3:]) / 3, workloads.accuracy(w, *held)


@pytest.fixture(scope="module")
def gat_full():
    return _train("gat", "fp", 20)


@pytest.mark.parametrize("level", ["L1.2", "L2.2"])
def test_gat_at_2_bits_trains_close_to_full_precision(gat_full, level):
    """GAT's attention coefficients come out of a scatter softmax (a max, an exp, a division by a sum): with
    the equality and log-domain rules it trains at 2 bits; before them it diverged (loss 8.8 against 3.3).
    Its exp results and coefficients are attention (at least 4 bits), and the features, which the loop holds,
    are read as they are. Over seeds 0 to 3 it ends 2.6% (L1.2) and 3.0% (L2.2) above full precision's loss
    on average, at most 4.0%."""
    (full_loss, _), (loss, _) = gat_full, _train("gat", level, 20)
    assert full_loss < 3.6, f"the baseline itself did not train ({full_loss:.3f})"
    assert loss <= 1.05 * full_loss, (loss, full_loss)


def test_resnet50_at_2_bits_is_within_2_points_of_full_precision_accuracy():
    """60 steps, accuracy on 1024 held-out images: full precision 99.6% and 99.9% (seeds 0 and 1), 2 bits
    99.2% and 99.3%. (At 40 steps 2 bits still trails, 92.2% against 96.6%: its gradients are noisier, and
    the variance, not a bias, is what more steps average out.)"""
    (_, full), (_, two_bits) = (
        _train("resnet50", "fp", 60, held_out=1024),
        _train("resnet50", "L1.2", 60, held_out=1024),
    )
    assert full >= 0.95, f"the baseline itself did not train ({full:.3f})"
    assert two_bits >= full - 0.02, (two_bits, full)


def _quality(spec, method, seeds=4):
    """Mean final loss over ``seeds`` (benchmarks/quality.py's runs), on one torch thread: a sum's order changes
    the last bits, and a run from scratch carries any change along."""
    import torch

    from benchmarks.quality import final_loss, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sum(final_loss(train(spec, method, seed)[0]) for seed in range(seeds)) / seeds
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_decoder_trained_from_scratch_at_the_default_level_keeps_pace_with_full_precision():
    """A Llama-style decoder from scratch, 200 steps past the phase where attention sharpens, four seeds. With its
    fused attention's query and key at 4 bits the default level ended 5.6% above full precision's mean loss (one
    seed 11%), and larger decoders collapsed back towards uniform's loss; at 8 bits it stays within 3%."""
    from benchmarks import llm
    from benchmarks.quality import Spec, decoder

    spec = Spec(decoder("scratch-tiny"), 200, llm.LLM_LR["scratch-tiny"])
    full, default = _quality(spec, "fp"), _quality(spec, gactx.get_optimization_level())
    assert full < 1.7, f"the baseline itself did not train ({full:.3f})"
    assert default <= 1.03 * full, (default, full)


@pytest.fixture(scope="module")
def sage_full():
    from benchmarks.quality import SPECS

    return _quality(SPECS["sage"], "fp")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["L1", "L2.2"])
def test_graphsage_over_four_seeds_is_within_3_percent_of_full_precision(sage_full, level):
    """GraphSAGE on the arxiv-shaped graph, 60 steps, four seeds (benchmarks/quality.py's run): the default level ends
    0.1% above full precision's mean loss, L2.2 1.9%."""
    from benchmarks.quality import SPECS

    full, compressed = sage_full, _quality(SPECS["sage"], level)
    assert full < 1.2, f"the baseline itself did not train ({full:.3f})"
    assert compressed <= 1.03 * full, (compressed, full)
