"""The free sensitivity estimate (gactx/controller/adaptation/free_sensitivity.py) and its use by the controller."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gactx
from benchmarks.estimators import spearman
from gactx.controller.adaptation.free_sensitivity import range_variance
from tests.controller.adaptation.models import scaled_mlp as _scaled_mlp


def _free(model, run, **options) -> gactx.Controller:
    controller = gactx.Controller(model, level="L2.2", estimator="actnn", **options)
    with controller:
        run()
        controller.iterate()
    return controller


def test_range_variance_is_the_sum_of_group_ranges_squared_over_6():
    t = torch.arange(600, dtype=torch.float32)
    # groups [0, 256), [256, 512) of range 255, and a tail of 88 elements of range 87
    expected = (2 * 256 * 255**2 + 88 * 87**2) / 6
    assert math.isclose(float(range_variance(t, 256)), expected, rel_tol=1e-6)


def test_the_free_estimate_is_finite_positive_and_ranks_like_gacts():
    model, x = _scaled_mlp()
    run = lambda: model(x).square().mean().backward()  # noqa: E731
    free = _free(model, run).sensitivity
    gact = gactx.Controller(model, level="L2.2")
    with gact:
        run()
        gact.adapt(run)
    assert set(free) == set(gact.sensitivity)
    assert all(math.isfinite(c) and c >= 0 for c in free.values())
    # The batch is alive when backward reads it: read from where it lives, its rounding costs nothing (both agree).
    assert free[("0", 1, 0)] == gact.sensitivity[("0", 1, 0)] == 0
    assert all(c > 0 for s, c in free.items() if s != ("0", 1, 0))
    linear_inputs = [s for s in gact.sensitivity if s[0] in ("2", "4", "6")]
    rho = spearman([gact.sensitivity[s] for s in linear_inputs], [free[s] for s in linear_inputs])
    assert rho == pytest.approx(1.0)
    # Same units: within a factor of 3 of GACT's where both are exact (inputs of linear layers)
    for s in linear_inputs:
        assert 1 / 3 < free[s] / gact.sensitivity[s] < 3, (s, free[s], gact.sensitivity[s])


class _NoHostReads(TorchDispatchMode):
    """Raises on a device-to-host read (``.item()``, ``float(t)``, ``.tolist()``) while ``armed``."""

    armed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.armed and func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a host read inside the collecting step")
        return func(*args, **(kwargs or {}))


def test_collecting_reads_nothing_to_the_host_inside_the_step():
    model, x = _scaled_mlp()
    controller = gactx.Controller(model, level="L2.2", estimator="actnn", op_rules="off")
    mode = _NoHostReads()
    with controller:
        collector = controller.estimator.collector
        # the hooks' reductions run under the mode: the observer and the gradient hooks
        for name in ("_observe", "_gradient"):
            hook = getattr(collector, name)

            def guarded(*args, hook=hook):
                mode.armed = True
                try:
                    with mode:
                        return hook(*args)
                finally:
                    mode.armed = False

            setattr(collector, name, guarded)
        model(x).square().mean().backward()
        assert collector.collected
        controller.iterate()
    assert controller.last_adaptation.passes == 0 and controller.sensitivity


def test_collecting_leaves_no_hooks_and_does_not_touch_the_model():
    model, x = _scaled_mlp()
    reference = [p.detach().clone() for p in model.parameters()]
    controller = gactx.Controller(model, level="L2.2", estimator="actnn")
    with controller:
        model(x).square().mean().backward()
        assert controller.estimator.collector.armed and controller.diagnostics()["observers"] == 2
        controller.iterate()
        assert not controller.estimator.collector.armed
        # What stays: the storage choices' meter (choices.py), armed only while an estimator measures.
        sizes = controller.diagnostics()
        assert sizes["observers"] == 1 and controller.estimator.meter is not None and sizes["output_hooks"] == 0
        model.zero_grad()
        model(x).square().mean().backward()  # step 2: nothing is due, nothing collects
        assert not controller.estimator.collector.armed
    assert all(torch.equal(a, p) for a, p in zip(reference, model.parameters(), strict=True))


def test_collecting_does_not_change_the_gradient():
    model, x = _scaled_mlp()
    grads = []
    for estimator in ("gact", "actnn"):
        model.zero_grad()
        with gactx.Controller(model, level="L2.2", estimator=estimator):
            model(x).square().mean().backward()  # step 1: the actnn controller collects in this one
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_iterate_without_a_closure_adapts_with_actnn_and_does_not_warn():
    model, x = _scaled_mlp()
    controller = gactx.Controller(model, level="L2.2", estimator="actnn", adapt_interval=3, adapt_backoff=1)
    steps = []
    with controller, warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(7):
            model.zero_grad()
            model(x).square().mean().backward()
            controller.iterate()
            steps.append(controller.last_adaptation.step)
    assert steps == [1, 1, 3, 3, 3, 6, 6]
    a = controller.last_adaptation
    assert a.passes == 0 and a.seconds >= 0 and controller.allocation
    assert len(set(controller.allocation.values())) > 1  # scales 0.01 to 30: not one width for all


def test_adapt_uses_the_collected_step_or_runs_one_closure_pass():
    model, x = _scaled_mlp()
    run = lambda: model(x).square().mean().backward()  # noqa: E731
    controller = gactx.Controller(model, level="L2.2", estimator="actnn")
    with controller:
        run()
        assert controller.adapt().passes == 0  # step 1 collected
        model.zero_grad()
        run()  # still step 0 (adapt() does not count steps): this pass collects too; drop what it read
        controller.estimator.collector.take()
        grads = [p.grad.clone() for p in model.parameters()]
        rng = torch.get_rng_state()
        adaptation = controller.adapt(run)
        assert adaptation.passes == 1 and controller.sensitivity
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
        assert torch.equal(rng, torch.get_rng_state())
        with pytest.raises(RuntimeError, match="no step under the controller collected"):
            controller.adapt()


@pytest.mark.parametrize("build", ["scaled mlp", "token stack"])
def test_an_unwatched_collecting_step_hooks_only_the_calls_that_saved_and_reads_the_same(build, monkeypatch):
    """In an unwatched pass every save is observed as it is made, so a module call that saved nothing gets no gradient
    hook (a watched pass may resolve a save after its call returns: there every call gets one). Read both ways in the
    same step, the estimate is the same."""
    model, x = _scaled_mlp() if build == "scaled mlp" else _token_stack()
    containers = sum(isinstance(m, nn.Sequential) for m in model.modules())  # calls that save nothing themselves
    hooks = []
    register = torch.Tensor.register_hook
    monkeypatch.setattr(torch.Tensor, "register_hook", lambda t, hook: hooks.append(1) or register(t, hook))
    controller = gactx.Controller(model, level="L2.2", estimator="actnn")
    collector, readings, counts = controller.estimator.collector, [], []
    with controller:
        model(x).square().mean().backward()
        controller.iterate()  # step 1 (watched) collected; the passes after it are not watched
        for watching in (collector.watching, lambda: True):
            collector.watching = watching
            controller.estimator.pending = True  # the next forward collects, as in the step before an adaptation
            model.zero_grad()
            hooks.clear()
            model(x).square().mean().backward()
            counts.append(len(hooks))
            readings.append(collector.take()[0])
            controller.estimator.pending = False
    assert counts[1] - counts[0] == containers
    assert readings[0] == readings[1] and any(c > 0 for c in readings[0].values())


def test_gact_adapt_still_needs_a_closure():
    model, x = _scaled_mlp()
    controller = gactx.Controller(model, level="L2.2")
    with controller:
        model(x).square().mean().backward()
        with pytest.raises(TypeError, match="needs a backprop closure"):
            controller.adapt()


def _token_stack() -> tuple[nn.Module, torch.Tensor]:
    """Pre-LayerNorm blocks over tokens whose first (a class token) varies 50 times less than the others: a group
    of 256 values that spans it rounds it with a step far wider than its spread."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(64, eps=1e-12), nn.Linear(64, 64), nn.GELU()) for _ in range(3)]
    x = torch.randn(16, 8, 64)
    x[:, 0] *= 0.02
    return nn.Sequential(*blocks, nn.Linear(64, 4)), x


def test_the_free_estimate_reports_each_normalization_inputs_noise_ratio():
    """rho = mean(R^2 / 6) * mean(1 / (var + eps)) for LayerNorm inputs as stored (groups of 256); none elsewhere."""
    from gactx.controller.adaptation.free_sensitivity import free_estimate

    model, x = _token_stack()
    controller = gactx.Controller(model, level="L2.2", estimator="actnn")
    with controller:
        model(x).square().mean().backward()
        estimate = free_estimate(model, controller.estimator.collector, None)
    assert set(estimate.ratios) == {("0.0", 1, 0), ("1.0", 1, 0), ("2.0", 1, 0)}
    first = estimate.ratios[("0.0", 1, 0)]
    expected = float(range_variance(x, 256)) / x.numel() * float((1 / (x.var(-1, unbiased=False) + 1e-12)).mean())
    assert first == pytest.approx(expected, rel=1e-4)
    assert first > 1000 and all(1 < r < 30 for s, r in estimate.ratios.items() if s != ("0.0", 1, 0))
    # BatchNorm's statistics span the batch: no ratio, no floor (its inputs at 1 bit measured no harm on ResNet-50)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    controller = gactx.Controller(model, level="L2.2", estimator="actnn")
    with controller:
        model(torch.randn(256, 64)).square().mean().backward()
        estimate = free_estimate(model, controller.estimator.collector, None)
    assert ("1", 1, 0) in estimate.sensitivity and estimate.ratios == {}


def test_actnn_gives_a_normalization_input_no_width_where_its_noise_outweighs_it():
    """The allocator offers a normalization input ActNN's estimator rated only the widths w with rho S(w) <= 1;
    without that, the zoo transformer layer's gradient error at L2.2 was 11 to 15 times the gradient (1e16 on a
    small ViT): its LayerNorm inputs got 1 bit, the free formula does not see them multiply the noise below."""
    from benchmarks.zoo import build
    from gactx.controller.adaptation import NOISE_CEILING, noise_floor
    from gactx.controller.adaptation.allocator import WIDTHS, variance_factor
    from gactx.controller.adaptation.free_sensitivity import free_estimate

    assert noise_floor(WIDTHS, 10.0) == (4, 8, 16, 32) and noise_floor(WIDTHS, 0.5) == WIDTHS
    model, x = _token_stack()
    run = lambda: model(x).square().mean().backward()  # noqa: E731
    controller = _free(model, run)
    with controller:
        ratios = free_estimate(model, controller.estimator.collector, run).ratios  # one pass, read as the step was
    for slot, rho in ratios.items():
        assert rho * variance_factor(controller.allocation[slot]) <= NOISE_CEILING, (slot, rho)
    assert controller.allocation[("0.0", 1, 0)] >= 4  # rho over 1000
    # The floor is paid from the level's budget, not added to it: the bytes stay what L2.2 allows, 2 bits an element
    # (4 for attention) and 8 bytes a group of each allocated tensor.
    a, group = controller.last_adaptation, controller.config.group_size
    numels = [(math.prod(r.key.shape), r.cls) for r in controller.records if r.allocated]
    assert a.budget_bytes == sum(n * (4 if cls == "attention" else 2) // 8 + 8 * -(-n // group) for n, cls in numels)
    assert a.allocated_bytes <= a.budget_bytes

    model, run = build("transformer_layer", 1)
    torch.manual_seed(0)
    exact = torch.autograd.grad(run(), list(model.parameters()))
    controller = gactx.Controller(model, level="L2.2", estimator="actnn", seed=0)
    with controller:
        run().backward()
        controller.iterate()
        model.zero_grad()
        torch.manual_seed(0)
        grads = torch.autograd.grad(run(), list(model.parameters()))
    error = sum(float((g - e).square().sum()) for g, e in zip(grads, exact, strict=True))
    assert error / sum(float(e.square().sum()) for e in exact) < 2


@pytest.mark.parametrize("width", [512, 128, 100])  # two groups of 256 a row; two rows a group; rows across groups
def test_a_linear_inputs_free_estimate_pairs_each_row_with_its_output_gradient(width):
    """ActNN's per-sample form for the input ``x`` of a linear layer, ``sum_n ||g_n||^2 v_n``: ``v_n`` the variance
    rounding adds to row ``n`` of ``x`` (each element its group's ``R^2 / 6``), ``g_n`` the gradient of the output row
    it makes. Whatever the rows' length against the groups of 256."""
    from gactx.controller.adaptation.free_sensitivity import free_estimate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(64, width) * torch.linspace(0.1, 3.0, 64)[:, None]  # rows of different ranges
    outputs = []

    def keep(module, args, out) -> None:
        out.retain_grad()
        outputs.append(out)

    model[0].register_forward_hook(keep)
    controller = gactx.Controller(model, level="L2.2", estimator="actnn")
    with controller:
        model(x.clone()).square().sum().backward()  # a copy that dies: the stored codes are read, not x
        estimate = free_estimate(model, controller.estimator.collector, None)
    out = outputs[0]
    flat = x.reshape(-1)
    pad = -flat.numel() % 256
    groups = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, 256)
    per_element = ((groups.amax(1) - groups.amin(1)).square() / 6).repeat_interleave(256)[: flat.numel()]
    expected = float((out.grad.square().sum(1) * per_element.view(64, width).sum(1)).sum())
    assert estimate.sensitivity[("0", 1, 0)] == pytest.approx(expected, rel=1e-5)
