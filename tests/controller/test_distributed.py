"""Under torch.distributed every rank must allocate the same bits and choices: two gloo processes on the CPU."""

import torch

from tests.helpers import on_two_ranks


def _worker(rank: int) -> dict:
    import torch.nn.functional as F

    import gactx
    import gactx.controller.adaptation.budget as budget_module
    from benchmarks.digits import digits_cnn

    torch.manual_seed(0)
    model = digits_cnn()  # the same initialisation everywhere
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    x, y = torch.randn(64, 1, 8, 8, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    raw = {}
    reduce = budget_module.reduce_across_ranks

    def spy(sensitivity, *tables):
        raw.update(sensitivity)
        return reduce(sensitivity, *tables)

    budget_module.reduce_across_ranks = spy
    controller = gactx.Controller(model, level="L2.2")
    with controller:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        controller.iterate(lambda: F.cross_entropy(model(x[:16]), y[:16]).backward())
    return {
        "loss": float(loss),
        "bits": sorted((repr(k), v) for k, v in controller.allocation.items()),
        # the default choices (normal-fitted levels) are priced from each rank's measured errors, averaged too
        "choices": sorted((repr(k), str(c)) for k, c in controller.plan.choices.items()),
        "reduced": sorted((repr(k), v) for k, v in controller.sensitivity.items()),
        "raw": sorted((repr(k), v) for k, v in raw.items()),
    }


def test_two_gloo_processes_choose_identical_bits(tmp_path):
    r0, r1 = on_two_ranks(_worker, tmp_path)
    assert r0["loss"] != r1["loss"], "the ranks saw different data"
    assert r0["reduced"] == r1["reduced"]
    assert r0["bits"] == r1["bits"] and len(r0["bits"]) >= 4
    assert r0["choices"] == r1["choices"]
    for (slot, a), (_, b), (_, mean) in zip(r0["raw"], r1["raw"], r0["reduced"], strict=True):
        assert abs((a + b) / 2 - mean) <= 1e-9 * max(1.0, abs(mean)), slot
