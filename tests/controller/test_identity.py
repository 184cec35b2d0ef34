"""gactx/controller/identity.py: pass boundaries survive interrupts and submodules called alone; keys stay
the same from step to step."""

import pytest
import torch
from torch import nn

import gactx


class Body(nn.Module):
    def __init__(self, interrupt: list[bool]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.interrupt = interrupt

    def forward(self, x):
        x = self.a(x).relu()
        if self.interrupt and self.interrupt.pop():
            raise KeyboardInterrupt  # Ctrl-C in the middle of a forward
        return self.b(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.interrupt: list[bool] = []
        self.body, self.head = Body(self.interrupt), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


def _keys(controller) -> list[str]:
    return [str(r.key) for r in controller.records]


@pytest.mark.parametrize("entry", ["model", "submodule"])
def test_an_interrupted_forward_leaves_keys_and_stats_as_before(entry):
    """nn.Module skips its always_call hooks on a BaseException: the next call finds the stale frames."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    run = model if entry == "model" else model.body
    with gactx.Controller(model, level="L1") as controller:
        run(x).sum().backward()
        keys, stats = _keys(controller), controller.memory_stats()
        for _ in range(3):
            model.interrupt.append(True)
            with pytest.raises(KeyboardInterrupt):
                run(x)
            run(x).sum().backward()
            assert _keys(controller) == keys
            assert controller.memory_stats() == stats
        assert not controller.diagnostics()["in_forward"]


def test_a_submodule_called_alone_starts_a_pass_each_step():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    with gactx.Controller(model, level="L1") as controller:
        model.body(x).sum().backward()
        keys = _keys(controller)
        assert keys and all(k.startswith("body") for k in keys) and not any("#" in k for k in keys)
        for _ in range(3):
            model.body(x).sum().backward()
            assert _keys(controller) == keys, "a second call of the same submodule is the next step"
        # Two submodules called one after the other, both alone, are one pass.
        model.head(model.body(x)).sum().backward()
        both = _keys(controller)
        assert both[: len(keys)] == keys and any(k.startswith("head") for k in both)


def test_a_recursive_call_of_the_model_is_not_an_interrupt():
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, depth=2):
            x = self.lin(x).relu()
            return self(x, depth - 1) if depth else x

    model, x = Recursive(), torch.randn(4, 8)
    with gactx.Controller(model, level="L1") as controller:
        model(x).sum().backward()
        keys = _keys(controller)
        assert keys[0] == "lin[0]" and "(root)#2[0]" in keys and "(root)#3[0]" in keys  # one pass, three calls


def _resident_bytes() -> int | None:
    """This process's resident memory now (Linux), or None where /proc does not tell."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def test_interrupts_evaluation_and_training_mixed_stay_flat():
    """2,000 steps: training, an interrupted forward, evaluation under no_grad, in turn. Nothing grows: the
    controller's tables, Python's objects, the process's resident memory."""
    import gc

    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 32)
    with gactx.Controller(model, level="L1") as controller:
        counts, resident = [], []
        for step in range(2000):
            kind = step % 3
            if kind == 0:
                model(x).sum().backward()
            elif kind == 1:
                model.interrupt.append(True)
                try:
                    model(x)
                except KeyboardInterrupt:
                    pass
            else:
                with torch.no_grad():
                    model(x)
            if step in (300, 1999):
                gc.collect()
                counts.append(len(gc.get_objects()))
                resident.append(_resident_bytes())
        model(x).sum().backward()
        sizes = controller.diagnostics()
        assert sizes["most_calls"] == 1 and not sizes["in_forward"]
        assert counts[1] - counts[0] < 200, counts
        if resident[0] is not None:  # 1,700 steps: a leak of 2 KB a step would show
            assert resident[1] - resident[0] < 3 << 20, f"resident memory grew {resident[1] - resident[0]} bytes"
        assert len(controller.sites) <= len(_keys(controller)) + 4


def test_a_forward_in_another_thread_leaves_this_threads_keys_alone():
    """The other thread's forward runs in the middle of this thread's (made so by a module that waits for
    it): its module calls are not this controller's, and its tensors are not compressed (saved-tensor hooks
    act in the thread that installed them)."""
    import threading

    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    outputs = []

    def evaluate():
        with torch.no_grad():
            outputs.append(model(x))

    def gate(module, args):
        if threading.current_thread() is threading.main_thread() and gated:
            thread = threading.Thread(target=evaluate)
            thread.start()
            thread.join()

    handle = model.head.register_forward_pre_hook(gate)
    with gactx.Controller(model, level="L1") as controller:
        gated = False
        model(x).sum().backward()
        keys, stats = _keys(controller), controller.memory_stats()
        gated = True
        model(x).sum().backward()
        assert outputs and _keys(controller) == keys and controller.memory_stats() == stats
    handle.remove()


def test_a_reentrant_checkpoints_recomputation_is_no_forward_pass():
    """torch.utils.checkpoint(use_reentrant=True) saves nothing in forward and recomputes in backward: those
    saves are compressed, counted apart and kept out of the pass's records, keys and adaptation."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)])
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            return self.head(x)

    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(32, 64, requires_grad=True)
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        model(x).sum()
    with gactx.Controller(model, level="L2.2") as controller:
        model(x).sum().backward()
        forward = controller.records
        assert [str(r.key) for r in forward] == [str(r.key) for r in controller.records]
        assert not any(r.key.module.startswith("blocks") or r.key.module == "<backward>" for r in forward)
        assert controller.memory_stats().original_bytes <= sum(t.numel() * t.element_size() for t in plain)
        report = controller.report()
        assert "saved while backward ran (recomputation)" in report
        controller.iterate(lambda: model(x[:8]).sum().backward())
        assert set(controller.sensitivity) <= {r.key[:3] for r in forward}


def test_a_module_outside_the_model_names_no_save_and_a_module_added_later_is_followed_once_installed_again():
    """The tracker finds a module among the model's by its id (attach() reads the model's modules): one the model does
    not hold, called inside its forward, is no frame of its own, and one added to it is followed from the next
    installation on."""
    torch.manual_seed(0)
    model, outside, x = Net(), nn.Linear(32, 32), torch.randn(16, 32)
    model.forward = lambda x: Net.forward(model, outside(x))
    controller = gactx.Controller(model, level="L1")
    with controller:
        model(x).sum().backward()
        assert _keys(controller) == ["(root)[0]", "body.a[0]", "body[0]", "head[0]"]  # outside's input: the root's
    model.extra = nn.Linear(4, 4)
    model.forward = lambda x: model.extra(Net.forward(model, x))
    with controller:
        model(x).sum().backward()
        assert _keys(controller) == ["body.a[0]", "body[0]", "head[0]", "extra[0]"]
