"""Where torch gives saved-tensor hooks no view of the graph AOTAutograd compiles (before 2.10): compiled regions keep
their saves, with one warning (gactx/controller/compiled.py, ``INLINE``)."""

import pytest
import torch

import gactx
from tests.controller.test_compiled import WIDTH, grads, mlp


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_torch_without_the_hooks_graph_context_keeps_compiled_saves_and_says_so_once(monkeypatch):
    """torch before 2.10 gives a hook AOTAutograd traces no context (``compiled.INLINE``): the hooks are then plain
    callables it does not inline, a compiled graph hands its saves to the eager path when its forward ends, and that
    keeps them (a compiled graph's saves carry no history to decide by). One warning a process, at install, names the
    page; the gradients are plain PyTorch's and the eager parts are compressed as usual."""
    import warnings

    from gactx.controller import compiled as compiled_module
    from gactx.controller import controller as controller_module

    monkeypatch.setattr(compiled_module, "INLINE", False)
    monkeypatch.setattr(controller_module, "INLINE", False)
    controller_module._warn_no_compiled_path.cache_clear()
    model, x = mlp(), torch.randn(64, WIDTH)
    plain = grads(model, model, x)
    compiled = torch.compile(model, backend="aot_eager")
    controller = gactx.Controller(model, level="L1")
    try:
        with pytest.warns(RuntimeWarning, match=r"docs/torch-compile\.md#torch-older-than-210") as caught:
            controller.install_hook()
        assert caught[0].filename == __file__  # the user's line
        assert all(isinstance(h, compiled_module.EagerHook) for h in controller.hooks)
        assert torch.equal(grads(compiled, model, x), plain)
        assert controller.records and not any(r.compressed for r in controller.records)
        controller.uninstall_hook()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            controller.install_hook()  # once a process
        assert not torch.equal(grads(model, model, x), plain)  # eager: compressed
        assert any(r.compressed for r in controller.records)
    finally:
        if controller.installed:
            controller.uninstall_hook()
        controller_module._warn_no_compiled_path.cache_clear()
