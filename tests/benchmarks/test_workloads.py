"""benchmarks/workloads.py: every workload builds at tiny size, trains, checkpoints by block and generates
its data deterministically; the full sizes are the published architectures; small sizes learn."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from benchmarks import workloads

NAMES = [n for n in workloads.names() if n != "llama-lora"]  # the classifiers; the LLM's own tests: test_llm.py
FAMILIES = {"gcn": "gnn", "sage": "gnn", "gat": "gnn", "bert-base": "transformer", "bert-large": "transformer",
            "vit-b16": "transformer", "resnet50": "cnn", "resnet152": "cnn", "llama-lora": "llm"}  # fmt: skip

# Published parameter counts: OGB's ogbn-arxiv leaderboard (GCN, GraphSAGE), Hugging Face's bert-base/large
# with a 2-label head and vit-base-patch16-224 with 1000 labels, torchvision's resnet50/152. GAT has no
# published twin at these widths: its count is ours (3 layers, 4x64 hidden heads, 1 output head).
FULL_PARAMETERS = {"gcn": 110_120, "sage": 218_664, "gat": 111_224, "bert-base": 109_483_778,
                   "bert-large": 335_143_938, "vit-b16": 86_567_656, "resnet50": 25_557_032,
                   "resnet152": 60_192_808}  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as under ``pytest -n 2``: these models gain little from a second one, and when the
    other core is busy a 2-thread step waits on it (small GCN, 15 steps: 0.7 s on one thread, up to 19 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _classes(w: workloads.Workload) -> int:
    inputs, _ = w.make_batch(w.default_batch, _gen(0))
    with torch.no_grad():
        return w.logits(w.model, inputs).shape[-1]


def test_names_and_families():
    assert workloads.names() == list(FAMILIES)
    for name in workloads.names():
        w = workloads.build(name, "tiny")
        assert (w.name, w.family, w.metric) == (name, FAMILIES[name], "accuracy")
        assert w.lr > 0 and w.default_batch >= 4


@pytest.mark.parametrize(("name", "size"), [("bert", "tiny"), ("gcn", "medium")])
def test_build_rejects_unknown_names_and_sizes(name, size):
    field = "name" if name == "bert" else "size"
    with pytest.raises(ValueError, match=rf"^{field} '{name if field == 'name' else size}' is not one of"):
        workloads.build(name, size)


def test_a_models_own_size_is_taken_by_it_alone():
    """BERT-large's first 6 layers at full width (the GPU evaluation's compiled arm): a size of that model only."""
    w = workloads.build("bert-large", "6 layers")
    config = w.model.config
    assert (config.num_hidden_layers, config.hidden_size, len(w.blocks)) == (6, 1024, 6)
    with pytest.raises(ValueError, match="^size '6 layers' is not one of"):
        workloads.build("bert-base", "6 layers")


@pytest.mark.parametrize("name", NAMES)
def test_tiny_forward_backward(name, device):
    w = workloads.build(name, "tiny", device)
    assert w.model.training and all(p.device.type == device for p in w.model.parameters())
    inputs, target = w.make_batch(w.default_batch, _gen(0))
    assert all(t.device.type == device for t in (*inputs, target))
    loss = w.loss(w.model, inputs, target)
    assert loss.shape == () and torch.isfinite(loss)
    # An untrained classifier is close to uniform: its loss is near log(classes).
    assert 0.5 * math.log(_classes(w)) < loss.item() < 2 * math.log(_classes(w))
    loss.backward()
    # A ResNet block's last BatchNorm starts at zero (zero_init_residual): until it moves, the branch before
    # it gets no gradient, and the block is the identity.
    gated = {f"{name}.{p}" for name, m in w.model.named_modules() if isinstance(m, workloads.Bottleneck)
             for p, _ in m.named_parameters() if not p.startswith(("bn3.", "downsample."))}  # fmt: skip
    for pname, p in w.model.named_parameters():
        assert p.requires_grad, pname
        assert p.grad is not None, f"{pname} gets no gradient"
        assert torch.isfinite(p.grad).all(), pname
        if pname in gated:
            assert p.grad.abs().sum() == 0, f"{pname} is behind a zero-initialized BatchNorm"
        else:
            assert p.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", NAMES)
def test_blocks_are_called_once_per_forward(name):
    w = workloads.build(name, "tiny")
    modules = list(w.model.modules())
    assert len(w.blocks) >= 2 and len({type(b) for b in w.blocks}) == 1
    assert all(any(b is m for m in modules) for b in w.blocks), "a block is not a submodule of the model"
    assert len({id(b) for b in w.blocks}) == len(w.blocks)
    owned = [{id(p) for p in b.parameters()} for b in w.blocks]
    assert sum(map(len, owned)) == len(set().union(*owned)) > 0, "blocks share parameters"
    calls = []
    hooks = [b.register_forward_hook(lambda m, i, o, k=k: calls.append(k)) for k, b in enumerate(w.blocks)]
    w.loss(w.model, *w.make_batch(w.default_batch, _gen(0)))
    for h in hooks:
        h.remove()
    assert calls == list(range(len(w.blocks))), "blocks must run once each, in order"


@pytest.mark.parametrize("name", NAMES)
def test_checkpointed_blocks_give_the_same_loss_and_gradients(name):
    """What the benchmark's checkpoint method does: every block's forward under non-reentrant checkpoint."""
    w = workloads.build(name, "tiny")
    inputs, target = w.make_batch(w.default_batch, _gen(0))

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(5)  # the same dropout masks in both runs
        loss = w.loss(w.model, inputs, target)
        loss.backward()
        grads = [p.grad for p in w.model.parameters()]
        w.model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    plain = loss_and_grads()
    for block in w.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    checkpointed = loss_and_grads()
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_make_batch_deterministic_and_shaped(name):
    w = workloads.build(name, "tiny")
    classes = _classes(w)
    (a, ya), (b, yb) = w.make_batch(6, _gen(3)), w.make_batch(6, _gen(3))
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True)) and torch.equal(ya, yb)
    c, _ = w.make_batch(6, _gen(4))
    assert not torch.equal(a[0], c[0])
    for batch in (5, 11):
        inputs, target = w.make_batch(batch, _gen(0))
        assert target.shape == (batch,) and target.dtype == torch.long
        assert 0 <= target.min() and target.max() < classes
        assert inputs[0].shape[0] == batch
        if w.family == "gnn":
            edge_index = inputs[1]
            assert edge_index.shape == (2, round(batch * 1_166_243 / 169_343))
            assert 0 <= edge_index.min() and edge_index.max() < batch
        assert w.logits(w.model, inputs).shape == (batch, classes)


@pytest.mark.parametrize("name", NAMES)
def test_labels_use_every_class(name):
    w = workloads.build(name, "tiny")
    classes = _classes(w)
    _, target = w.make_batch(100 * classes, _gen(0))
    counts = torch.bincount(target, minlength=classes).float()
    assert counts.min() > 0.5 * counts.mean(), f"unbalanced labels: {counts.tolist()}"


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first, again, other = (workloads.build("bert-base", "tiny", seed=s).model.state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("name", ["gat", "resnet50"])
def test_accuracy_in_eval_mode_restores_train_mode(name):
    w = workloads.build(name, "tiny")
    inputs, target = w.make_batch(64, _gen(0))
    acc = workloads.accuracy(w, inputs, target)
    assert w.model.training and all(p.grad is None for p in w.model.parameters())
    w.model.eval()
    with torch.no_grad():
        expected = (w.logits(w.model, inputs).argmax(-1) == target).float().mean().item()
    assert acc == expected and 0 <= acc <= 1
    assert workloads.accuracy(w, inputs, target) == acc and not w.model.training  # eval stays eval


@pytest.mark.parametrize("name", NAMES)
def test_full_sizes_have_the_published_parameter_counts(name):
    with torch.device("meta"):  # shapes only: bert-large's 335M parameters cost nothing
        w = workloads.BUILDERS[name](name, "full", torch.device("meta"))
    assert sum(p.numel() for p in w.model.parameters()) == FULL_PARAMETERS[name]
    blocks = {"gcn": 3, "sage": 3, "gat": 3, "bert-base": 12, "bert-large": 24, "vit-b16": 12, "resnet50": 16,
              "resnet152": 50}  # fmt: skip
    assert len(w.blocks) == blocks[name]
    assert w.default_batch == {"gnn": 169_343, "transformer": 64 if name == "vit-b16" else 32, "cnn": 64}[w.family]


@pytest.mark.parametrize("name", ["gcn", "bert-base", "resnet50"])
def test_small_learns_in_15_adam_steps(name):
    torch.manual_seed(0)  # dropout's masks: the test is one fixed run
    w = workloads.build(name, "small")
    held_out = w.make_batch(w.default_batch, _gen(1000))

    def held_out_loss() -> float:
        w.model.eval()
        with torch.no_grad():
            loss = w.loss(w.model, *held_out).item()
        w.model.train()
        return loss

    before, gen = held_out_loss(), _gen(0)
    optimizer = torch.optim.Adam(w.model.parameters(), lr=w.lr)
    for _ in range(15):
        w.loss(w.model, *w.make_batch(w.default_batch, gen)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = held_out_loss()
    assert after < 0.9 * before, (before, after)
    assert workloads.accuracy(w, *held_out) > 1 / _classes(w) + 0.2
