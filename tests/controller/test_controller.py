"""gactx/controller/controller.py: installation, the pack policy, dedupe, keys, stats, no synchronization."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx
from gactx.controller import Packed


def _linear_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _saved(model, run, **options):
    """Run one forward under a controller; return the controller and the loss (graph alive)."""
    controller = gactx.Controller(model, **options).install_hook()
    try:
        loss = run()
    finally:
        controller.uninstall_hook()
    return controller, loss


def test_bad_model_and_double_install():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        gactx.Controller(lambda x: x)
    controller = gactx.Controller(_linear_model())
    controller.install_hook()
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            controller.install_hook()
    finally:
        controller.uninstall_hook()
    with pytest.raises(RuntimeError, match="not installed"):
        controller.uninstall_hook()
    with pytest.raises(ValueError, match="unknown level"):
        gactx.Controller(_linear_model(), level="fast")
    with pytest.raises(TypeError, match="backprop must be callable"):
        controller.iterate(3)


def test_hooks_come_off_in_the_order_they_went_on():
    model, x = _linear_model(), torch.randn(4, 64)
    first, second = gactx.Controller(model, level="L1"), gactx.Controller(model, level="L1.2")
    first.install_hook()
    second.install_hook()
    with pytest.raises(RuntimeError, match="installed after this Controller"):
        first.uninstall_hook()
    assert first.installed and second.installed
    model(x).sum().backward()
    assert second.memory_stats().original_bytes > 0, "the last installed acts"
    second.uninstall_hook()
    first.uninstall_hook()
    assert not first.installed and not second.installed


def test_under_hooks_that_hand_each_save_on_to_gactxs_each_forward_is_a_pass_of_its_own():
    # A library that composes saved-tensor hooks pushes its own pair, which calls the pair it found: gactx's.
    model, x = _linear_model(), torch.randn(32, 64)
    with gactx.Controller(model, level="L1") as controller:
        model(x).sum().backward()
        one_pass = controller.memory_stats()
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: pack(t), lambda h: unpack(h)):
            for _ in range(3):
                model(x).sum().backward()
                assert controller.memory_stats() == one_pass, "the saves of one pass, not piled on the last"
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # hooks that keep every save
            model(x).sum().backward()
        assert controller.memory_stats() == one_pass, "a pass gactx never saw a save of leaves the last one"


def test_uninstalling_from_another_thread_is_refused():
    model = _linear_model()
    controller = gactx.Controller(model).install_hook()
    errors = []

    def other():
        try:
            controller.uninstall_hook()
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "another thread" in errors[0]
    assert controller.installed
    controller.uninstall_hook()


def test_context_manager_installs_and_removes_hooks():
    model = _linear_model()
    x = torch.randn(32, 64)
    with gactx.Controller(model, level="L1.2") as controller:
        assert controller.installed
        loss = model(x).sum()
    assert not controller.installed
    loss.backward()
    # Linear 0 saves x; ReLU saves its output (as a 1-bit mask: its backward reads the sign only), which
    # Linear 2 saves again (quantized: its backward needs the values).
    assert (controller.memory_stats().compressed, controller.memory_stats().deduplicated) == (3, 0)
    model(x).sum().backward()  # after exit nothing is packed any more
    assert controller.memory_stats().compressed == 3


def test_parameters_views_and_buffers_are_never_compressed():
    model = nn.Linear(64, 64, bias=False)
    model.register_buffer("scale", torch.randn(64, 64))
    x = torch.randn(2048, 64)
    run = lambda: (x @ model.weight.t() @ model.weight[:, :].t() * model.scale[0]).sum()  # noqa: E731
    controller, loss = _saved(model, run, level="L1.2", min_numel=1)
    kept = {tuple(r.key.shape) for r in controller.records}
    assert (64, 64) not in kept, "a parameter or a view of it was treated as an activation"
    loss.backward()


def test_buffers_of_modules_added_and_buffers_replaced_after_installation_are_kept():
    model = nn.Linear(64, 64)
    x = torch.randn(2048, 64)
    with gactx.Controller(model, level="L1", min_numel=1) as controller:
        model(x).sum().backward()  # the model's storages were read: those added since must still be found
        model.extra = nn.Module()  # a module added after installation, never called
        model.extra.register_buffer("scale", torch.randn(64, 64))
        for _ in range(2):
            model.extra.scale = torch.randn(64, 64)  # a new storage each pass, as model.to() makes one
            (model(x) * model.extra.scale[0]).sum().backward()
            assert all(r.key.shape != (64,) for r in controller.records), "a view of a buffer was compressed"


def test_autocast_copies_of_weights_are_kept():
    model = _linear_model()
    x = torch.randn(64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        controller, loss = _saved(model, lambda: model(x).float().sum(), level="L1.2", min_numel=1)
    records = controller.records
    weights = [(128, 64), (10, 128), (128, 10)]  # the copies, and the transpose that the second linear saves
    assert all(r.key.shape not in weights for r in records), "an autocast weight copy was compressed"
    assert any(r.dtype == torch.bfloat16 and r.bits == 2 for r in records), "bf16 activations must be compressed"
    loss.backward()


def test_integer_small_and_float64_tensors_are_kept_and_bool_masks_packed():
    emb = nn.Embedding(100, 64)
    idx = torch.randint(0, 100, (64, 64))

    def run():
        h = emb(idx)  # saves int64 indices
        mask = h > 0  # a bool mask, saved by where
        d = torch.where(mask, h, h * 0.1).double().sin()  # float64 saved by sin
        return d.sum() + h[:2, :2].exp().sum()  # a small tensor saved by exp

    controller, loss = _saved(emb, run, level="L1.2")
    by_dtype = {(r.dtype, r.label) for r in controller.records}
    assert (torch.int64, "dtype int64") in by_dtype
    assert (torch.float64, "dtype float64") in by_dtype
    assert (torch.bool, "1") in by_dtype
    assert (torch.float32, "small") in by_dtype
    grad_compressed = torch.autograd.grad(loss, emb.weight)[0]
    grad_plain = torch.autograd.grad(run(), emb.weight)[0]
    assert F.cosine_similarity(grad_compressed.flatten(), grad_plain.flatten(), dim=0) > 0.95


class QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return F.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)


@pytest.mark.parametrize("dedupe", [True, False])
def test_a_tensor_saved_three_times_is_stored_once(dedupe):
    model = QKV()
    x = torch.randn(4, 64, 64)
    controller, loss = _saved(model, lambda: model(x).sum(), level="L1.1", dedupe=dedupe)
    stats = controller.memory_stats()
    # x is saved by q, k and v; softmax saves its output, which the matmul with v saves again.
    assert stats.deduplicated == (3 if dedupe else 0)
    assert stats.compressed == (5 if dedupe else 8)
    grad = torch.autograd.grad(loss, model.q.weight)[0]
    plain = torch.autograd.grad(model(x).sum(), model.q.weight)[0]
    assert F.cosine_similarity(grad.flatten(), plain.flatten(), dim=0) > 0.99


def test_later_saves_of_a_tensor_share_its_first_saves_width():
    """The allocator sees the input of Q, K and V once, under Q's slot (K's and V's saves share Q's in the pass it
    measures): whatever width Q gets, K and V must share it, not store another copy outside the budget."""
    model = QKV()
    x = torch.randn(4, 64, 64)
    controller = gactx.Controller(model, level="L2.2", adapt_interval=10**9)
    with controller:
        model(x).sum().backward()
        state = controller.state_dict()
        state["bits"] = [["q", 1, 0, 8]]  # every other slot at the default width, 2
        controller.load_state_dict(state)
        model(x).sum().backward()
        records = {r.key[:3]: r for r in controller.records}
        assert records[("q", 1, 0)].bits == 8 and ("k", 1, 0) not in records and ("v", 1, 0) not in records
        assert controller.memory_stats().deduplicated == 3
        assert controller.shared_with(gactx.Slot("q", 1, 0)) == {("k", 1, 0), ("v", 1, 0)}


def test_in_place_change_between_saves_is_not_deduplicated():
    x = torch.randn(64, 64, requires_grad=True)  # h has a history: outside the model, a tensor without one is kept
    w = nn.Linear(64, 64)

    def run():
        h = x * 1.0
        a = (h @ w.weight).sum()  # saves h at version 0
        h.mul_(2.0)
        return a + (h @ w.weight).sum()  # saves h at version 1: another tensor

    controller, loss = _saved(w, run, level="L1.1")
    assert controller.memory_stats().deduplicated == 0
    grad = torch.autograd.grad(loss, w.weight)[0]
    expected = 3 * x.sum(0)[:, None].expand(64, 64)  # d/dW of sum(h W) + sum(2h W); reusing h would give 2x
    assert (grad - expected).norm() / expected.norm() < 0.02  # the wrong version would be off by 1/3


def test_keys_are_stable_across_steps_and_name_modules():
    model = _linear_model()
    x = torch.randn(32, 64)
    keys = []
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            model(x).sum().backward()
            keys.append([r.key for r in controller.records])
            controller.iterate()
    assert keys[0] == keys[1] == keys[2]
    assert [k.module for k in keys[0]] == ["0", "1", "2"]  # ReLU's mask, and its output again as Linear 2's input
    assert "0[0]" in controller.report() and "float32" in controller.report()


def test_memory_stats_before_any_forward_and_after_eval():
    model = _linear_model()
    controller = gactx.Controller(model)
    assert controller.memory_stats().original_bytes == 0
    with controller:
        model(torch.randn(32, 64)).sum().backward()
        before = controller.memory_stats()
        with torch.no_grad():
            model(torch.randn(32, 64))
    assert controller.memory_stats() == before, "an evaluation pass that saves nothing must not erase the stats"


def test_unsupported_tensors_are_kept_not_dropped():
    x = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)
    run = lambda: (x * x).abs().sum()  # noqa: E731
    controller, loss = _saved(nn.Identity(), run, level="L1.2", min_numel=1)
    assert {(r.bits, r.reason) for r in controller.records} == {(None, "dtype complex64")}
    assert torch.equal(torch.autograd.grad(loss, x)[0], torch.autograd.grad(run(), x)[0])


def test_no_host_synchronization_in_pack_or_unpack(monkeypatch):
    """On a CPU the GPU cannot be watched; instead any read of a tensor's value into Python fails."""
    model = _linear_model()
    x = torch.randn(256, 64)
    controller = gactx.Controller(model, level="L1.2")

    def forbidden(*args, **kwargs):
        raise AssertionError("pack or unpack read a tensor value on the host")

    # The whole step: pack, the compression of saves whose op the watcher names one op later, and unpack.
    for _ in range(2):  # watched, then not
        with controller, monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
                m.setattr(torch.Tensor, name, forbidden)
            model(x).sum().backward()
        assert controller.memory_stats().compressed == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_gpu_synchronization_on_cuda():
    model = _linear_model().cuda()
    x = torch.randn(256, 64, device="cuda")
    with gactx.Controller(model, level="L1.2"):
        loss = model(x).sum()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(x).sum()
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_handles_are_released_with_the_graph():
    import gc
    import weakref

    from tests.helpers import live

    model = _linear_model()
    controller, loss = _saved(model, lambda: model(torch.randn(32, 64)).sum(), level="L1")
    handles = live(Packed)
    assert len(handles) == 3
    refs = [weakref.ref(h) for h in handles]
    del handles
    loss.backward()
    del loss
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("level", ["L0", "L1.2"])
def test_a_forward_never_run_backward_is_freed(level):
    """Kept outputs (log_softmax's, ReLU's at L0) must not tie their node to themselves: a graph dropped
    without backward (evaluation with grad enabled, a step abandoned after an error) is freed at once."""
    import weakref

    from tests.helpers import live

    model = _linear_model()
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with gactx.Controller(model, level=level) as controller:
        logp = F.log_softmax(model(x), dim=1)
        loss = F.nll_loss(logp, y)
    assert controller.memory_stats().tensors >= 3
    ref = weakref.ref(logp)
    del logp, loss
    assert ref() is None  # freed by reference counting alone
    assert live(Packed) == []


def test_a_config_object_and_the_public_read_api():
    model, x = _linear_model(), torch.randn(32, 64)
    config = gactx.Config.for_level("L1.2", group_size=128)
    assert (config.bits, config.group_size, config.level) == (2, 128, "L1.2")
    controller = gactx.Controller(model, config=config)
    assert controller.config is config
    with pytest.raises(TypeError, match="either config= or a level"):
        gactx.Controller(model, "L1", config=config)
    with pytest.raises(TypeError, match="config must be a gactx.Config"):
        gactx.Controller(model, config={"bits": 2})
    assert controller.records == [] and controller.allocation == {}
    with controller:
        model(x).sum().backward()
    records = controller.records
    assert [str(r.key) for r in records] == [str(r.key) for r in controller.records]
    assert {r.bits for r in records if r.op.startswith("addmm")} == {2}
    records[0].bits = 99  # a copy: the controller's own records do not change
    assert controller.records[0].bits != 99
    adaptive = gactx.Controller(model, level="L2.2")
    with adaptive:
        model(x).sum().backward()
        adaptive.iterate(lambda: model(x[:8]).sum().backward())
    allocation = adaptive.allocation
    assert allocation and all(b in (1, 2, 4, 8, 16, 32) for b in allocation.values())
    allocation.clear()
    assert adaptive.allocation


def test_a_batch_sliced_from_a_dataset_counts_its_rows_not_the_dataset():
    """X[:64] keeps X's storage alive, but X lives anyway (the dataset): the bytes a view covers are what it
    adds, in rows and totals alike, as for X[:64].clone()."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    data, labels = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    stats = []
    for x, y in ((data[:64], labels[:64]), (data[:64].clone(), labels[:64].clone())):
        with gactx.Controller(model, level="L1", min_numel=1) as controller:
            F.cross_entropy(model(x), y).backward()
        stats.append(controller.memory_stats())
        records = controller.records
    assert stats[0] == stats[1] and stats[0].original_bytes < 100_000  # the dataset is 1 MiB
    target = [r for r in records if r.dtype == torch.int64]
    assert [r.storage_bytes for r in target] == [64 * 8]


def test_views_of_one_storage_count_each_byte_once():
    from gactx.controller.stats import cover

    ranges = []
    assert cover(ranges, 0, 100) == 100 and cover(ranges, 50, 150) == 50 and cover(ranges, 0, 150) == 0
    assert cover(ranges, 200, 300) == 100 and cover(ranges, 140, 210) == 50 and ranges == [(0, 300)]
    assert cover(ranges, 10, 10) == 0
