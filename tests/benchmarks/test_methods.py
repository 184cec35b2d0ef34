"""benchmarks/methods.py: checkpointing with a gactx level, and methods that take turns on one model."""

from __future__ import annotations

import pytest
import torch

from benchmarks import workloads
from benchmarks.methods import Method, method_names


def _hooks_on() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _checkpointed(w) -> bool:
    return all("forward" in vars(block) for block in w.blocks)


def test_checkpointing_with_a_level_is_both_and_takes_turns():
    w = workloads.build("bert-base", "tiny")
    method = Method("checkpoint+L1", w)
    assert method.controller is not None and method.controller.config.level == "L1"
    assert _checkpointed(w) and _hooks_on()
    method.suspend()
    assert not _checkpointed(w) and not _hooks_on()
    with method.active():
        assert _checkpointed(w) and _hooks_on()
        inputs, target = w.make_batch(4, torch.Generator().manual_seed(0))
        with method.forward():
            w.loss(w.model, inputs, target).backward()
        assert method.controller.memory_stats().packed_bytes > 0  # gactx stored what the blocks' inputs left
    assert not _checkpointed(w) and not _hooks_on()
    method.close()
    assert not _checkpointed(w) and not _hooks_on()


def test_two_methods_on_one_model_do_not_mix():
    w = workloads.build("resnet50", "tiny")
    first, second = Method("checkpoint", w), None
    first.suspend()
    second = Method("L1.2", w)
    assert not _checkpointed(w) and _hooks_on()
    second.suspend()
    with first.active():
        assert _checkpointed(w) and not _hooks_on()
    for method in (first, second):
        method.close()
    assert not _checkpointed(w) and not _hooks_on()


def test_a_models_own_checkpointing_is_used_where_it_has_one():
    calls = []
    w = workloads.build("gcn", "tiny")
    w.checkpointing = calls.append
    method = Method("checkpoint", w)
    method.suspend()
    with method.active():
        pass
    method.close()
    assert calls == [True, False, True, False] and not _checkpointed(w)


def test_names_are_checked():
    assert "checkpoint+L1" in method_names() and "checkpoint+L3" not in method_names()
    with pytest.raises(ValueError, match="^method 'checkpoint\\+L9' is not one of"):
        Method("checkpoint+L9", workloads.build("gcn", "tiny"))


@pytest.mark.parametrize("form", ["checkpoint-fast", "checkpoint-selective"])
def test_each_form_of_checkpointing_gives_plain_gradients_where_the_model_draws_no_noise(form):
    # Every block checkpointed in the form (the model's own checkpointing left alone): a model without dropout (the
    # tiny ResNet) gets plain's gradients, to float32's rounding of a recomputation.
    w = workloads.build("resnet50", "tiny")
    w.checkpointing = lambda on: pytest.fail("a form of checkpointing used the model's own")
    inputs, target = w.make_batch(4, torch.Generator().manual_seed(0))
    w.loss(w.model, inputs, target).backward()
    plain = [p.grad.clone() for p in w.model.parameters()]
    w.model.zero_grad(set_to_none=True)
    method = Method(form, w)
    assert _checkpointed(w)
    with method.forward():
        loss = w.loss(w.model, inputs, target)
    loss.backward()
    for a, b in zip(plain, (p.grad for p in w.model.parameters()), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    method.close()
    assert not _checkpointed(w)


def test_checkpoint_fast_keeps_the_rng_state_of_a_model_with_dropout():
    from benchmarks.methods import _checkpoint_options

    assert _checkpoint_options("checkpoint-fast", workloads.build("bert-base", "tiny").model)["preserve_rng_state"]
    assert not _checkpoint_options("checkpoint-fast", workloads.build("resnet50", "tiny").model)["preserve_rng_state"]
