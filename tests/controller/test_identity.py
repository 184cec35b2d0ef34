"""gactx/controller/identity.py: pass boundaries survive interrupts and submodules called alone; keys stay
the same from step to step, and by position the same as every module followed."""

import pytest
import torch
from torch import nn

import gactx
from gactx.controller import identity


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


@pytest.mark.parametrize("native", [True, False], ids=["lane", "python"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_each_backward_of_one_graph_recomputes_its_checkpointed_regions_with_the_same_noise(
    monkeypatch, reentrant, native
):
    """``loss.backward(retain_graph=True)`` then ``loss.backward()`` recompute each checkpointed region: its saves are
    keyed within each backward, so both draw the same noise and give the same gradients, as plain PyTorch does; the
    next step draws other noise. With the C++ lane (the forward's saves replayed from the third step on) and without."""
    from torch.utils.checkpoint import checkpoint

    from gactx.controller import lane

    monkeypatch.setattr(lane, "NATIVE", native)

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2)
            )
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            for block in self.blocks:
                x = x + checkpoint(block, x, use_reentrant=reentrant)
            return self.head(x)

    def gradient() -> torch.Tensor:
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        return grad

    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(128, 64, requires_grad=reentrant)
    steps = []
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(4):
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            first = gradient()
            loss.backward()
            assert torch.equal(gradient(), first)
            assert controller.memory_stats(backward=True).compressed > 0  # the recomputed saves are gactx's
            steps.append(first)
            controller.iterate()
        assert controller.diagnostics()["keys_by_position"]
    assert not any(torch.equal(a, b) for a, b in zip(steps[:-1], steps[1:], strict=True))  # each step's noise its own


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


# -- keys by position --------------------------------------------------------------------------------------------


class Scaled(nn.Linear):
    """A linear layer whose op is called from code of its own: another call site than nn.Linear's."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class Block(nn.Module):
    """Saves inside a child's call, then in its own frame after the child returned, then in the child's second call."""

    def __init__(self, lin: nn.Module | None = None, act=torch.tanh) -> None:
        super().__init__()
        self.lin, self.act = lin or nn.Linear(32, 32), act

    def forward(self, x):
        h = self.lin(x)
        return self.lin(self.act(h) * 2) + h.sigmoid()


class Switch(nn.Module):
    """a, then b where ``extra`` says, then c; ``skip_c`` leaves c out. b is like a and c (``like=True``) or saves first
    from another call site (its linear layer's own code)."""

    def __init__(self, like: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(), Block() if like else Block(Scaled(32, 32)), Block()
        self.extra, self.skip_c = False, False

    def forward(self, x):
        x = self.a(x)
        if self.extra:
            x = self.b(x)
        return x if self.skip_c else self.c(x)


def _step(model, controller, x) -> list[str]:
    model(x).sum().backward()
    controller.iterate()
    return _keys(controller)


def _by_position(controller) -> bool:
    return controller.diagnostics()["keys_by_position"]


def _followed_then_by_position(monkeypatch):
    """The loop's body twice, from seed 0: with every module followed (keys never by position), then as gactx runs."""
    for followed in (True, False):
        with monkeypatch.context() as patch:
            if followed:
                patch.setattr(identity, "MAX_DIVERGENCES", 0)
            torch.manual_seed(0)
            yield followed


def test_keys_by_position_are_the_followed_keys_and_leave_only_the_models_hooks(monkeypatch):
    """Two passes that save the same make the third go by position: the same keys, records and gradients (the noise
    seeds are the keys'), bit for bit, as every module followed; the submodules have no hooks of gactx's then."""
    grads = {}
    for followed in _followed_then_by_position(monkeypatch):
        model, x = Switch(), torch.randn(16, 32)
        steps = []
        with gactx.Controller(model, level="L1") as controller:
            for _ in range(5):
                keys = _step(model, controller, x)
                grad = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                steps.append((keys, controller.memory_stats(), grad))
                model.zero_grad()
            assert _by_position(controller) is not followed
            hooked = [name for name, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
            assert hooked == ([name for name, _ in model.named_modules()] if followed else [""])
        grads[followed] = steps
    for (keys, stats, g), (keys_f, stats_f, g_f) in zip(grads[False], grads[True], strict=True):
        assert keys == keys_f and stats == stats_f
        assert all(torch.equal(a, b) for a, b in zip(g, g_f, strict=True))
    assert any("#2" in k for k in keys) and "a[0]" in keys  # a child's second call, a save in the block's own frame


def test_a_pass_that_differs_from_its_position_is_keyed_as_a_followed_pass_from_there_on():
    """b's first save is no save of c's (the same tensor, shape and node, saved from another call site): the stack is
    rebuilt where the pass stands (a's calls replayed, b and b.lin found running by their frames), so b.lin's return,
    which no hook saw, and the second call of b.lin are named as a followed pass names them. The next pass follows
    every module; passes by position come back after two repeats in a row (twice as many as the first time)."""
    torch.manual_seed(0)
    model, x = Switch(), torch.randn(16, 32)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            _step(model, controller, x)
        assert _by_position(controller)
        model.extra = True
        diverged = _step(model, controller, x)
        assert not _by_position(controller) and controller.diagnostics()["divergences"] == 1
        followed = _step(model, controller, x)
        assert diverged == followed and "b.lin#2[0]" in followed and "b[0]" in followed
        assert not _by_position(controller)
        _step(model, controller, x)
        assert not _by_position(controller), "after a divergence: two repeats"
        _step(model, controller, x)
        assert _by_position(controller)
        assert _step(model, controller, x) == followed


def test_a_block_like_the_next_inserted_is_taken_for_it_for_one_pass():
    """What keys by position cannot see (identity.py): b saves what c saved, in shape, dtype, node and call site. Its
    saves take c's keys in that pass (the ops, and so the rules, are the same), c's then get new keys, stored as a
    new key's are; the pass ends keys by position, and the next names every save as followed."""
    torch.manual_seed(0)
    model, x = Switch(like=True), torch.randn(16, 32)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            before = _step(model, controller, x)
        model.extra = True
        taken = _step(model, controller, x)
        assert taken[: len(before)] == before and not any(k.startswith("b") for k in taken)
        assert not _by_position(controller)
        followed = _step(model, controller, x)
        assert [k for k in followed if k.startswith("b")] == ["b.lin[0]", "b[0]", "b.lin#2[0]", "b[1]"]
        assert followed == [k for k in followed if not k.startswith("c")] + before[len(before) // 2 :]


def test_a_pass_by_position_with_fewer_saves_ends_them_and_a_model_that_keeps_changing_is_followed_for_good():
    torch.manual_seed(0)
    model, x = Switch(), torch.randn(16, 32)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            keys = _step(model, controller, x)
        model.skip_c = True
        short = _step(model, controller, x)
        assert short == keys[: len(short)] and not _by_position(controller)
        model.skip_c = False
        for divergences in range(2, identity.MAX_DIVERGENCES + 1):  # stable for a while, then once the other branch
            steps = 0
            while not _by_position(controller):
                _step(model, controller, x)
                steps += 1
            assert steps == 1 << divergences - 1, "twice the repeats after each divergence"
            model.skip_c = True
            _step(model, controller, x)
            model.skip_c = False
        assert controller.diagnostics()["divergences"] == identity.MAX_DIVERGENCES
        for _ in range(40):
            _step(model, controller, x)
        assert not _by_position(controller)
        assert all(m._forward_pre_hooks for m in model.modules())


def test_a_submodule_called_alone_while_keys_go_by_position_is_named_as_a_followed_one(monkeypatch):
    """body's first save comes while no pass of the model is under way (keys by position hold only the model's hook):
    its frames show body running, so it joins the pass as a followed submodule call does (its second call)."""
    keys = {}
    for followed in _followed_then_by_position(monkeypatch):
        model, x = Net(), torch.randn(16, 32)
        with gactx.Controller(model, level="L1") as controller:
            for _ in range(3):
                model(x).sum().backward()
            assert _by_position(controller) is not followed
            whole = _keys(controller)
            model.body(x.clone()).sum().backward()  # a new input: each of body's saves stored anew
            keys[followed] = _keys(controller)
            assert not _by_position(controller) and not controller.diagnostics()["in_forward"]
    assert keys[False] == keys[True] == whole + ["body.a#2[0]", "body#2[0]"]


def test_the_free_estimate_follows_every_module_while_it_collects():
    """ActNN's estimate hooks module outputs: a pass by position where it collects gets every module's hooks back."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(256, 32)
    controller = gactx.Controller(model, level="L2", estimator="actnn", adapt_interval=4)
    by_position, keys = [], set()
    with controller:
        for _ in range(6):
            model(x).sum().backward()
            controller.iterate()
            by_position.append(_by_position(controller))
            keys.add(tuple(_keys(controller)))
    assert by_position == [False, True, True, False, True, True]  # step 4's estimate is collected in pass 4
    assert controller.last_adaptation.step == 4 and len(controller.sensitivity) == 3
    assert len(keys) == 1 and controller.diagnostics()["divergences"] == 0


def test_an_adaptations_probes_on_a_sub_batch_leave_keys_by_position_as_they_were():
    """GACT's estimate runs the closure on a sub-batch (other shapes): its passes follow every module and count neither
    as repeats nor as divergences, and the next training pass, which repeats the training's, goes by position again."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(256, 32)
    controller = gactx.Controller(model, level="L2.2", adapt_interval=3)
    with controller:
        keys = set()
        for _ in range(3):
            model(x).sum().backward()
            keys.add(tuple(_keys(controller)))
        assert _by_position(controller)
        controller.iterate(lambda: model(x[:64]).sum().backward())  # the step where it adapts
        assert controller.last_adaptation is not None and controller.diagnostics()["divergences"] == 0
        for _ in range(2):
            model(x).sum().backward()
            keys.add(tuple(_keys(controller)))
            assert _by_position(controller)
        assert len(keys) == 1 and controller.diagnostics()["divergences"] == 0
