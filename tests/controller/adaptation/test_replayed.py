"""gactx/controller/adaptation/replayed.py and gactx/controller/probes.py: an estimate's passes from one forward."""

import pytest
import torch
import torch.nn.functional as F

import gactx
from benchmarks.digits import digits_cnn, digits_data
from gactx.controller.adaptation import gact_estimator, passes, replayed
from tests.conftest import DEVICES


def _adapt(
    replay: bool, monkeypatch, grad_only: bool = False, partial: bool = False, device: str = "cpu", level: str = "L2.2"
) -> tuple[dict, dict, int, int]:
    """The digits CNN (BatchNorm, dropout) adapted twice at ``level`` on ``device``: its sensitivities, allocation,
    passes and how many times the closure ran."""
    monkeypatch.setattr(replayed, "REPLAY", replay)
    monkeypatch.setattr(replayed, "PARTIAL", partial)
    monkeypatch.setattr(gact_estimator, "RECHECK", 1)  # the later estimate's first pass as the closure's own: replayed
    (x, y), _ = digits_data()
    x, y = x.to(device), y.to(device)
    torch.manual_seed(0)
    model = digits_cnn().to(device)
    runs = 0

    def backprop():
        nonlocal runs
        runs += 1
        loss = F.cross_entropy(model(x[:16]), y[:16])
        if grad_only:  # gradients written by hand: no backward call to replay
            params = [p for p in model.parameters() if p.requires_grad]
            for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                p.grad = g
        else:
            loss.backward()

    with gactx.Controller(model, level=level) as controller:
        F.cross_entropy(model(x[:64]), y[:64]).backward()
        first = controller.adapt(backprop)
        later = controller.adapt(backprop)
    return dict(controller.sensitivity), dict(controller.allocation), first.passes + later.passes, runs


def test_replaying_the_backward_measures_what_running_the_closure_measures(monkeypatch):
    """Each pass after an estimate's base replays the closure's backward: the same sensitivities to the last bit and
    the same allocation as running the closure every pass, which ran once for each pass; with replays, once an
    estimate (the forward every probe reads, whose backward's replay is the first pass too:
    gact_estimator.REPLAY_FIRST)."""
    whole = _adapt(False, monkeypatch)
    replays = _adapt(True, monkeypatch)
    assert replays[0] == whole[0] and replays[1] == whole[1] and replays[2] == whole[2]
    assert whole[3] == whole[2] and replays[3] == 2


def _spied(monkeypatch) -> dict:
    """How many passes :meth:`replayed.Replayed.difference` measured from the nodes, and how many it left whole."""
    counts = {"from the nodes": 0, "whole": 0}
    difference = replayed.Replayed.difference

    def spy(self, *args):
        out = difference(self, *args)
        counts["whole" if out is None else "from the nodes"] += 1
        return out

    monkeypatch.setattr(replayed.Replayed, "difference", spy)
    return counts


@pytest.mark.parametrize("level", ["L2", "L2.2"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_pass_from_the_probed_nodes_measures_what_the_whole_backward_measures(device, level, monkeypatch):
    """Every probe pass of the digits CNN runs backward from the nodes that read what it probes: the same
    sensitivities as whole replays up to rounding, and the same allocation; on a GPU too (a parameter that no probed
    noise reaches counts a zero on the gradients' device)."""
    whole = _adapt(True, monkeypatch, device=device, level=level)
    counts = _spied(monkeypatch)
    partial = _adapt(True, monkeypatch, partial=True, device=device, level=level)
    assert partial[1] == whole[1] and partial[2] == whole[2] and partial[3] == 2
    assert partial[0] == pytest.approx(whole[0], rel=1e-5)
    # On a GPU a node whose call outside the engine does not give the engine's result bit for bit (checked once a
    # node: an atomics-based convolution gradient, say) leaves its passes to whole replays.
    assert counts["from the nodes"] > counts["whole"] if device == "cuda" else counts["whole"] == 0


@pytest.mark.parametrize(
    "name",
    [
        "bert",
        "lstm",
        "custom_function",
        "checkpointed",
        "gat",
        "mlp",
        "resnet",
        "transformer_layer",
        "gcn",
        "sage",
        "conv3d",
    ],
)
def test_a_pass_from_the_probed_nodes_measures_alike_on_other_models(name, monkeypatch):
    """A position embedding added by broadcasting (BERT: the node's result summed as the engine sums it), oneDNN's
    LSTM, a Python autograd function's saves (whole replays), a checkpointed model, GAT's shared saves, and the rest
    of the zoo that ``benchmarks.schemes`` measures: the same sensitivities as whole replays up to rounding (a
    sensitivity a millionth of the largest is rounding in both), and the same allocation. Each pass its own backward
    below the probed nodes (no cut shared: ``test_cuts.py``)."""
    from benchmarks.zoo import build

    monkeypatch.setattr(passes, "CUTS", False)
    results = []
    for partial in (False, True):
        monkeypatch.setattr(replayed, "PARTIAL", partial)
        counts = _spied(monkeypatch)
        model, run = build(name, 1)
        with gactx.Controller(model, "L2.2", seed=0) as controller:
            torch.manual_seed(0)
            run().backward()
            controller.adapt(lambda run=run: (torch.manual_seed(0), run().backward()))
        results.append((dict(controller.sensitivity), dict(controller.allocation), dict(counts)))
    (whole, whole_bits, _), (partial, partial_bits, counts) = results
    largest = max(whole.values())
    assert partial_bits == whole_bits and partial == pytest.approx(whole, rel=1e-4, abs=1e-6 * largest)
    assert counts["from the nodes"] > 0
    if name == "custom_function":
        assert counts["whole"] > 0  # read by a Python function's node


def test_a_closure_without_a_backward_call_runs_whole_every_pass(monkeypatch):
    """A closure that writes gradients from ``torch.autograd.grad`` has no backward call to replay: it runs every pass,
    and measures what the backward closure measures."""
    whole = _adapt(False, monkeypatch)
    by_hand = _adapt(True, monkeypatch, grad_only=True)
    assert by_hand[0] == pytest.approx(whole[0], rel=1e-6) and by_hand[3] == by_hand[2]


@pytest.mark.parametrize("after", ["nothing", "clipped in place", "written over", "set before"])
def test_the_recording_runs_gradients_are_the_base_unless_the_closure_touched_them(after, monkeypatch):
    """The forward the probes read is recorded with the closure's own backward: where the closure did nothing else to
    the gradients, the base is what that backward left, and no backward is replayed for it; where it clipped them in
    place, wrote them over after its backward or set them before it, the calls are replayed for the base. Either way
    the sensitivities are those of the same closure without the rest, to the last bit."""
    monkeypatch.setattr(replayed, "REPLAY", True)
    (x, y), _ = digits_data()
    replays = []
    call = replayed.Replayed.__call__

    def spy(self):
        recorded = self.calls is not None
        call(self)
        if not recorded:
            replays.append(not self._untouched)

    monkeypatch.setattr(replayed.Replayed, "__call__", spy)
    results = []
    for rest in ("nothing", after):
        torch.manual_seed(0)
        model = digits_cnn()
        params = [p for p in model.parameters() if p.requires_grad]

        def backprop(rest=rest, model=model, params=params):
            if rest == "set before":
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
            F.cross_entropy(model(x[:16]), y[:16]).backward()
            if rest == "clipped in place":
                torch.nn.utils.clip_grad_norm_(params, 1e-3)
            elif rest == "written over":
                for p in params:
                    p.grad = p.grad * 2

        with gactx.Controller(model, level="L2.2") as controller:
            F.cross_entropy(model(x[:64]), y[:64]).backward()
            controller.adapt(backprop)
        results.append(dict(controller.sensitivity))
    assert results[1] == results[0]
    assert replays == [False, after != "nothing"]


def test_the_forward_the_probes_read_is_freed_after_the_estimate(monkeypatch):
    """The recorded backward calls keep their graphs (and the saves a deferring forward kept) only while the estimate
    runs."""
    import weakref

    monkeypatch.setattr(replayed, "REPLAY", True)
    (x, y), _ = digits_data()
    torch.manual_seed(0)
    model = digits_cnn()
    losses = []

    def backprop():
        loss = F.cross_entropy(model(x[:16]), y[:16])
        losses.append(weakref.ref(loss))
        loss.backward()

    with gactx.Controller(model, level="L2.2") as controller:
        F.cross_entropy(model(x[:64]), y[:64]).backward()
        controller.adapt(backprop)
    assert len(losses) == 1 and all(ref() is None for ref in losses)


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)) for _ in range(3)
        )
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_model_measures_alike_replayed(reentrant, monkeypatch):
    """Checkpointed regions recompute inside each replayed backward; a reentrant checkpoint's own backward call, made
    inside the closure's, is replayed with it, not recorded as one of the closure's: the sensitivities of running the
    closure every pass, up to the rounding of a pass from the probed nodes (a norm where a whole pass sums squares)."""
    results = []
    for replay in (False, True):
        monkeypatch.setattr(replayed, "REPLAY", replay)
        torch.manual_seed(0)
        model, x = _Checkpointed(reentrant), torch.randn(32, 64, requires_grad=reentrant)
        with gactx.Controller(model, "L2.2") as controller:
            model(x).square().mean().backward()
            controller.adapt(lambda model=model, x=x: model(x).square().mean().backward())
        results.append(dict(controller.sensitivity))
    assert results[1] == pytest.approx(results[0], rel=1e-6) and len(results[0]) >= (4 if reentrant else 1)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_model_replays_its_first_pass(reentrant, monkeypatch):
    """The saves a checkpointed region's recomputation makes inside backward are no training pass's records, and no
    part of what the replayed first pass's forward is checked against (``gact_estimator.REPLAY_FIRST``): the closure
    runs once an estimate, for the sensitivities and allocation of a first pass of its own."""
    results = []
    for replay_first in (False, True):
        monkeypatch.setattr(gact_estimator, "REPLAY_FIRST", replay_first)
        torch.manual_seed(0)
        model, x = _Checkpointed(reentrant), torch.randn(32, 64, requires_grad=reentrant)
        calls = [0]

        def closure(model=model, x=x, calls=calls):
            calls[0] += 1
            model(x).square().mean().backward()

        with gactx.Controller(model, "L2.2", seed=0) as controller:
            model(x).square().mean().backward()
            controller.adapt(closure)
        results.append((dict(controller.sensitivity), dict(controller.allocation), calls[0]))
    (ran, ran_bits, twice), (replayed_first, bits, once) = results
    assert (twice, once) == (2, 1) and bits == ran_bits and replayed_first == pytest.approx(ran, rel=1e-9)


def test_the_given_gradients_are_read_a_window_at_a_time(monkeypatch):
    """The gradients the probed nodes are given in the base are read for at most ``WINDOW`` nodes at a time, those the
    pass needs first and then those of the slots expected next: with a window of 2 the zoo ResNet's BatchNorm inputs
    measure what whole replays measure (each pass its own backward below them), and no more than 2 nodes' gradients
    are ever held."""
    from benchmarks.zoo import build

    monkeypatch.setattr(passes, "CUTS", False)
    held, reads = [], []
    read = replayed.Replayed._read

    def spy(self, nodes):
        read(self, nodes)
        reads.append(len(nodes))
        held.append(len(self._given))

    results = []
    for partial in (False, True):
        monkeypatch.setattr(replayed, "PARTIAL", partial)
        monkeypatch.setattr(replayed, "WINDOW", 2)
        monkeypatch.setattr(replayed.Replayed, "_read", spy)
        model, run = build("resnet", 1)
        with gactx.Controller(model, "L2.2", seed=0) as controller:
            torch.manual_seed(0)
            run().backward()
            controller.adapt(lambda run=run: (torch.manual_seed(0), run().backward()))
        results.append((dict(controller.sensitivity), dict(controller.allocation)))
    assert results[1][1] == results[0][1] and results[1][0] == pytest.approx(results[0][0], rel=1e-4)
    assert reads and max(held) <= 2 and len(reads) < sum(1 for _ in results[0][0])


def test_a_deferring_forward_that_learns_its_ops_defers_every_save(monkeypatch):
    """An adaptation of a model switched to eval mode after training (as ``benchmarks.adaptation`` adapts the trained
    digits CNN): its first pass meets ops the path has not learned (BatchNorm on running statistics, no dropout), so
    the forward its probes replay is a watched one (each save's op learned at the next op's dispatch). Its saves are
    deferred all the same: the sensitivities of running the closure every pass, none lost to a save the replays could
    not probe (all were 0 before)."""
    (x, y), _ = digits_data()
    results = []
    for replay in (False, True):
        monkeypatch.setattr(replayed, "REPLAY", replay)
        torch.manual_seed(0)
        model = digits_cnn()
        with gactx.Controller(model, level="L2.2") as controller:
            F.cross_entropy(model(x[:64]), y[:64]).backward()
            controller.adapt(lambda model=model: F.cross_entropy(model(x[:16]), y[:16]).backward())
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[:64]), y[:64]).backward()
            model.eval()
            later = controller.adapt(lambda model=model: F.cross_entropy(model(x[:16]), y[:16]).backward())
        results.append((dict(controller.sensitivity), dict(controller.allocation), later))
    (whole, whole_bits, _), (replays, replay_bits, later) = results
    assert sum(1 for c in whole.values() if c > 0) >= 3
    assert replay_bits == whole_bits and replays == pytest.approx(whole, rel=1e-5)
    assert later.partial_passes > 0


def test_a_pass_from_the_nodes_that_fails_leaves_whole_replays(monkeypatch, caplog):
    """A node that cannot be called outside the engine in a way no check foresaw (here: every call raises) costs the
    estimate its partial passes, not its result: whole replays from then on, the sensitivities of PARTIAL off to the
    last bit, and an INFO line that says so."""
    whole = _adapt(True, monkeypatch)

    def broken(self, node):
        raise RuntimeError("a node this device cannot call")

    monkeypatch.setattr(replayed.Replayed, "_call", broken)
    counts = _spied(monkeypatch)
    with caplog.at_level("INFO", logger=replayed.__name__):
        failing = _adapt(True, monkeypatch, partial=True)
    assert failing[0] == whole[0] and failing[1] == whole[1] and failing[2] == whole[2]
    assert counts["from the nodes"] == 0 and counts["whole"] > 0
    assert "failed (a node this device cannot call); whole replays from here on" in caplog.text


def test_an_estimates_window_holds_the_nodes_of_its_later_measurements(monkeypatch):
    """The window of given gradients is filled with the nodes of the measurements after the one under way too (the
    curves' second widths read the same normalisation nodes as their first): where every probed node fits in one
    window, as on the zoo BERT, an estimate reads its base gradients once."""
    from benchmarks.zoo import build

    reads = []
    read = replayed.Replayed._read

    def spy(self, nodes):
        read(self, nodes)
        reads.append(len(self._given))

    monkeypatch.setattr(replayed.Replayed, "_read", spy)
    model, run = build("bert", 1)
    with gactx.Controller(model, "L2.2", seed=0) as controller:
        torch.manual_seed(0)
        run().backward()
        adaptation = controller.adapt(lambda: (torch.manual_seed(0), run().backward()))
    parts = adaptation.passes_by_part
    assert parts["curve widths"][1] > 0 and parts["against the base"][1] > 0 and parts["linear inputs together"][1] > 0
    assert len(reads) == 1 and reads[0] <= replayed.WINDOW


@pytest.mark.parametrize("name", ["bert", "transformer_layer", "mlp"])
def test_a_node_is_called_exactly_once_a_window(name, monkeypatch):
    """A pass that calls the same node as the pass before (the linear inputs probed together and their sketches'
    calibration pairs; the queries and keys one attention product reads) takes that pass's exact results
    (``KEEP_EXACT``): fewer node calls, and the sensitivities and allocation of calling it every pass, bit for bit."""
    from benchmarks.zoo import build

    results = []
    for keep in (False, True):
        monkeypatch.setattr(replayed, "KEEP_EXACT", keep)
        calls = [0]
        call = replayed.Replayed._call

        def spy(self, node, call=call, calls=calls):
            calls[0] += 1
            return call(self, node)

        monkeypatch.setattr(replayed.Replayed, "_call", spy)
        model, run = build(name, 1)
        with gactx.Controller(model, "L2.2", seed=0) as controller:
            torch.manual_seed(0)
            run().backward()
            controller.adapt(lambda run=run: (torch.manual_seed(0), run().backward()))
        monkeypatch.setattr(replayed.Replayed, "_call", call)
        results.append((dict(controller.sensitivity), dict(controller.allocation), calls[0]))
    (each, each_bits, each_calls), (kept, kept_bits, kept_calls) = results
    assert kept == each and kept_bits == each_bits
    assert kept_calls < each_calls
