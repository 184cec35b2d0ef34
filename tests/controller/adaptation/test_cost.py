"""gactx/controller/adaptation/cost.py: a training step's wall time, an adaptation's share of training, and the warning
a slow adaptation gives where a user sees it."""

import time
import types
import warnings

import pytest
import torch
from torch import nn

import gactx
from gactx.controller.adaptation import cost


def test_the_step_clock_takes_the_median_step_and_leaves_adaptations_out(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(cost.time, "perf_counter", lambda: now[0])
    clock = cost.StepClock()
    assert clock.seconds is None
    clock.start()
    now[0] += 5.0  # the first step: from installation to the first iterate()
    clock.tick()
    assert clock.seconds == 5.0 and clock.first_only
    for step in (0.2, 0.3, 0.25):
        now[0] += step
        clock.tick()
    assert not clock.first_only and clock.seconds == pytest.approx(0.275)  # median of 5, 0.2, 0.3, 0.25
    now[0] += 60.0  # an adaptation
    clock.resume()
    now[0] += 0.25
    clock.tick()
    assert clock.seconds == pytest.approx(0.25)


def test_share_of_training():
    assert cost.share(6.0, 0.063, 1000) == pytest.approx(6.0 / 69.0)
    assert cost.share(0.0, 0.1, 1000) == 0.0 and cost.share(1.0, None, 1000) is None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))


def test_a_slow_adaptation_warns_with_its_cost_and_share(monkeypatch):
    monkeypatch.setattr(cost, "SLOW_SECONDS", 0.0)  # every adaptation is slow here
    model, x = _model(), torch.randn(16, 32)

    def backprop():
        model(x).square().mean().backward()

    controller = gactx.Controller(model, level="L2.2", adapt_interval=4).install_hook()
    try:
        with pytest.warns(gactx.SlowAdaptationWarning, match=r"adaptation at step 1: \d+ passes"):
            backprop()
            controller.iterate(backprop)  # step 1: the first adaptation, read against the first step
        first = controller.last_adaptation
        assert first.step_seconds is not None and 0 < first.share < 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                backprop()
                time.sleep(0.01)  # a step of at least 10 ms
                controller.iterate(backprop)  # step 4 adapts
        slow = [w for w in caught if issubclass(w.category, gactx.SlowAdaptationWarning)]
        a = controller.last_adaptation
        # Read against the interval to the next adaptation: 4 steps, or 8 where this one kept the allocation
        # (schedule.py)
        assert a.interval == (8 if a.stable else 4)
        assert len(slow) == 1 and f"% of training at one adaptation every {a.interval} steps" in str(slow[0].message)
        assert a.step == 4 and a.step_seconds >= 0.01
        assert a.share == pytest.approx(a.seconds / (a.seconds + a.interval * a.step_seconds))
        assert f"% of training at one every {a.interval} steps" in controller.report()
    finally:
        controller.uninstall_hook()


@pytest.mark.parametrize("call", ["iterate", "adapt", "gactx's Trainer callback"])
def test_a_slow_adaptation_warns_at_the_users_line_and_says_what_to_do(monkeypatch, call):
    """The warning names the first line outside gactx, the one that called ``iterate()`` or ``adapt()``, or gactx's
    Hugging Face callback (not a line of gactx, nor the caller's caller), and says that training goes on, what costs
    less and how to silence it."""
    monkeypatch.setattr(cost, "SLOW_SECONDS", 0.0)
    model, x = _model(), torch.randn(16, 32)

    def backprop():
        model(x).square().mean().backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "gactx's Trainer callback":
            pytest.importorskip("transformers")
            from gactx.integrations import GactxCallback

            class WithLoss(nn.Module):  # a model as a Trainer calls it: keyword arguments in, an output with .loss
                def __init__(self) -> None:
                    super().__init__()
                    self.body = model

                def forward(self, x):
                    return types.SimpleNamespace(loss=self.body(x).square().mean())

            wrapped = WithLoss()
            callback = GactxCallback(level="L2.2", probe_batch={"x": x})
            callback.on_train_begin(None, None, None, model=wrapped)
            try:
                wrapped(x).loss.backward()
                line = _line() + 1
                callback.on_step_end(None, None, None, model=wrapped)  # what the Trainer does after a step
            finally:
                callback.on_train_end(None, None, None)
        else:
            with gactx.Controller(model, level="L2.2") as controller:
                backprop()
                line = _line() + 1
                controller.iterate(backprop) if call == "iterate" else controller.adapt(backprop)
    (slow,) = [w for w in caught if issubclass(w.category, gactx.SlowAdaptationWarning)]
    assert (slow.filename, slow.lineno) == (__file__, line)
    text = str(slow.message)
    assert "Not an error" in text and "adapt_interval" in text and "estimator='actnn'" in text
    assert "warnings.filterwarnings('ignore', category=gactx.SlowAdaptationWarning)" in text


def _line() -> int:
    """The line number of the caller's line."""
    import sys

    return sys._getframe(1).f_lineno


@pytest.mark.parametrize("estimator", ["gact", "actnn"])
def test_an_adaptations_seconds_count_its_allocation(monkeypatch, estimator):
    """``Adaptation.seconds`` is the whole adaptation's wall time: the allocation after the estimate too (here made
    0.3 s slower), with either estimator."""
    from gactx.controller import controller as module

    allocate = module.allocate_estimate

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(module, "allocate_estimate", slow)
    model, x = _model(), torch.randn(16, 32)

    def backprop():
        model(x).square().mean().backward()

    with gactx.Controller(model, level="L2.2", estimator=estimator) as controller:
        backprop()
        start = time.perf_counter()
        a = controller.adapt(backprop)
        took = time.perf_counter() - start
    assert a.seconds >= 0.3
    if estimator == "gact":  # the free estimator's seconds include its hooks in the step before
        assert a.seconds <= took


def test_a_quick_adaptation_does_not_warn():
    model, x = _model(), torch.randn(16, 32)

    def backprop():
        model(x).square().mean().backward()

    with gactx.Controller(model, level="L2.2") as controller, warnings.catch_warnings():
        warnings.simplefilter("error", gactx.SlowAdaptationWarning)
        backprop()
        controller.iterate(backprop)
    assert controller.last_adaptation.seconds < cost.SLOW_SECONDS


@pytest.mark.parametrize("slow", [False, True])
def test_a_long_adaptation_shows_its_progress_at_warning(caplog, monkeypatch, slow):
    """Progress lines go to INFO; past SLOW_SECONDS (0 here when ``slow``) one every VISIBLE_SECONDS (0 here) goes to
    WARNING, which Python prints to stderr where no logging is set up (gactx adds no handler of its own)."""
    import logging

    from gactx.controller.adaptation import estimators

    monkeypatch.setattr(estimators, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(estimators, "VISIBLE_SECONDS", 0.0)
    monkeypatch.setattr(cost, "SLOW_SECONDS", 0.0 if slow else float("inf"))
    model, x = _model(), torch.randn(16, 32)

    def backprop():
        model(x).square().mean().backward()

    caplog.set_level(logging.INFO, logger="gactx")
    with gactx.Controller(model, level="L2.2") as controller, warnings.catch_warnings():
        warnings.simplefilter("ignore", gactx.SlowAdaptationWarning)
        backprop()
        controller.iterate(backprop)
    progress = [r for r in caplog.records if "passes of the closure," in r.getMessage() and " of " in r.getMessage()]
    progress = [r for r in progress if "% of training" not in r.getMessage()]  # the closing line is INFO
    assert len(progress) >= 2  # a line a tensor measured, here
    assert {r.levelno for r in progress} == {logging.WARNING if slow else logging.INFO}
    assert not logging.getLogger("gactx").handlers and not logging.getLogger("gactx.controller").handlers
