"""The op watcher: which op and which argument or result each save is, learned in eager mode."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx
from gactx.controller.rules import Site, sketchable
from gactx.controller.watch import OpWatcher


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = F.relu(self.lin(x))  # addmm saves mat1; relu saves its result
        h = F.dropout(h, 0.5)  # mul saves the float mask ("other")
        return torch.sigmoid(h).amax(1)  # sigmoid saves its result; amax its input and result


def _sites(controller):
    return [(r.op, r.cls) for r in controller.records if r.op]


def _step(model, controller, x):
    with controller:
        model(x).sum().backward()


def test_sites_of_a_watched_pass():
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    _step(model, controller, x)
    assert _sites(controller) == [
        ("addmm:mat1", "linear"),
        ("relu", "threshold"),
        ("mul:other", "dropout"),
        ("sigmoid", "smooth"),
        ("amax", "equality"),
        ("amax", "equality"),
    ]
    assert controller.diagnostics()["watched_ops"] > 0


def test_what_was_learned_serves_the_next_passes_without_watching():
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    _step(model, controller, x)
    learned = _sites(controller)
    ops = controller.diagnostics()["watched_ops"]
    for batch in (64, 17):  # a new batch size: new keys, the same slots
        _step(model, controller, torch.randn(batch, 32))
        assert _sites(controller) == learned
    assert controller.diagnostics()["watched_ops"] == ops, "a pass with nothing new is not watched"


def test_a_new_save_is_watched_in_the_next_pass():
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    _step(model, controller, x)
    # Another graph through the same module: the tanh result takes the slot of the dropout mask. It must not
    # be read as one (its node is TanhBackward0, the mask had none): its grad_fn names it, and the slot is
    # watched again in the next pass.
    model.forward = lambda x: torch.tanh(F.relu(model.lin(x))).sum(1)
    _step(model, controller, x)
    assert [c for _, c in _sites(controller)] == ["linear", "threshold", "smooth"]
    assert controller.diagnostics()["watch_next"]
    _step(model, controller, x)
    assert _sites(controller) == [("addmm:mat1", "linear"), ("relu", "threshold"), ("tanh", "smooth")]


@pytest.mark.parametrize("op_rules", ["always", "off"])
def test_always_watches_and_off_never_does(op_rules):
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1", min_numel=0, op_rules=op_rules)
    counts = []
    for _ in range(3):
        _step(model, controller, x)
        counts.append(controller.diagnostics()["watched_ops"])
    if op_rules == "always":
        assert counts[0] < counts[1] < counts[2]
        assert ("mul:other", "dropout") in _sites(controller)
    else:
        assert counts == [0, 0, 0]
        # results still name their op through grad_fn; inputs are quantized as linear
        assert ("relu", "threshold") in _sites(controller) and ("sigmoid", "smooth") in _sites(controller)
        assert {c for _, c in _sites(controller)} <= {"threshold", "smooth", "equality", "linear (op unknown)"}


def test_unknown_op_rules_value_is_refused():
    with pytest.raises(ValueError, match="op_rules='sometimes'"):
        gactx.Controller(Block(), op_rules="sometimes")


def test_saves_of_a_custom_function_are_linear_not_misread():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    class M(nn.Module):
        def forward(self, x):
            return F.gelu(Square.apply(x))

    x = torch.randn(64, 64, requires_grad=True)
    controller = gactx.Controller(M(), level="L1.1", min_numel=0)
    with controller:
        out = M()(x)  # not the controller's model: nothing is watched, so the saves are unknown
    assert {r.cls for r in controller.records} <= {"linear (op unknown)", ""}
    out.sum().backward()


def test_watching_is_off_under_no_grad_and_at_l0():
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1")
    with controller, torch.no_grad():
        model(x)
    assert controller.diagnostics()["watched_ops"] == 0
    l0 = gactx.Controller(model, level="L0")
    _step(model, l0, x)
    assert l0.diagnostics()["watched_ops"] == 0


def test_report_shows_op_and_class():
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    _step(model, controller, x)
    report = controller.report()
    assert "op" in report.splitlines()[1] and "class" in report.splitlines()[1]
    assert "mul:other" in report and "dropout" in report and "equality" in report


def test_a_result_saved_again_by_an_unknown_op_is_not_read_as_the_result():
    """ReLU's result is saved by ReLU (a mask) and by each call of the next layer (values). A second call,
    new in an unwatched pass, must get values: the ReLU node's result save was already seen."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.lin2, self.calls = nn.Linear(32, 32), nn.Linear(32, 32), 1

        def forward(self, x):
            h = F.relu(self.lin(x))
            return sum(self.lin2(h) for _ in range(self.calls))

    model, x = Net(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1.1", min_numel=0, dedupe=False)
    _step(model, controller, x)
    model.calls = 2
    _step(model, controller, x)
    assert [r.cls for r in controller.records] == ["linear", "threshold", "linear", "linear (op unknown)"]


def test_probabilities_computed_by_hand_are_attention():
    """torch_geometric's softmax over a node's edges (GAT's coefficients): an exp, a division by the sums,
    and the coefficients reach the message product through a view. The exp result saved again as the
    division's numerator shares its one copy."""

    class HandSoftmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            e = self.lin(x).exp()
            p = e / e.sum(1, keepdim=True)
            return (p.unsqueeze(-1) * x.unsqueeze(1)).sum(1)

    model, x = HandSoftmax(), torch.randn(64, 32, requires_grad=True)
    controller = gactx.Controller(model, level="L1.2", min_numel=0)
    for _ in range(2):  # watched, then learned
        _step(model, controller, x)
        assert _sites(controller) == [
            ("addmm:mat1", "linear"),
            ("exp", "attention"),
            ("div:other", "log domain"),
            ("mul:other", "linear"),
            ("mul", "attention"),
        ]
        assert [r.bits for r in controller.records if r.cls == "attention"] == [4, 4]
    assert controller.memory_stats().deduplicated >= 1


# -- matrix operands whose partner is a weight: the inputs of linear layers (rules.sketchable) -----------------


class _Held:
    """A pending handle for the watcher alone: the saved tensor, and the site the watcher gives it."""

    def __init__(self, t):
        self.stored, self.site = t, None


def _watched_saves(run) -> list[tuple[Site, torch.Size]]:
    """``(site, shape)`` of every save ``run()`` makes, named by an ``OpWatcher`` without the controller."""
    watcher = OpWatcher(lambda handle, site, origin: setattr(handle, "site", site))
    held = []

    def pack(t):
        handle = _Held(t)
        held.append(handle)
        watcher.pending.append((handle, watcher.result_site(t)))
        return handle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda handle: handle.stored), watcher:
        out = run()
    watcher.flush()
    out.sum().backward()  # the saves are what backward needs
    return [(h.site, h.stored.shape) for h in held]


def _sketchable_ops(run) -> list[tuple[str, bool]]:
    """``(str(site), sketchable)`` of every save that is not a parameter."""
    saves = []
    for site, _ in _watched_saves(run):
        saves.append((str(site), sketchable(site)))
    return saves


@pytest.mark.parametrize("shape", [(8, 12), (2, 4, 12)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_input_of_a_linear_layer_is_sketchable(shape, bias):
    lin = nn.Linear(12, 5, bias=bias)
    x = torch.randn(shape, requires_grad=True)
    saves = _watched_saves(lambda: lin(x))
    op = "addmm" if bias else "mm"
    activation = "mat1" if bias else "self"
    by_role = {site.role: (site, size) for site, size in saves}
    site, size = by_role[activation]
    assert site.op == op and site.weight_operand and sketchable(site)
    assert size.numel() == x.numel()
    weight, _ = by_role["mat2"]  # the weight's own save: its partner is the input, not a weight
    assert not weight.weight_operand and not sketchable(weight)


def test_products_with_a_weight_in_any_form_are_sketchable():
    w = nn.Parameter(torch.randn(12, 5))
    lin = nn.Linear(12, 5)
    x = torch.randn(2, 4, 12, requires_grad=True)
    assert sorted(_sketchable_ops(lambda: x @ w)) == [("mm", True), ("mm:mat2", False)]
    assert ("bmm", True) in _sketchable_ops(lambda: torch.einsum("bsd,de->bse", x, w))
    h = torch.randn(12, 7, requires_grad=True)
    assert ("mm:mat2", True) in _sketchable_ops(lambda: lin.weight @ h), "a weight on the left"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the weight is a bf16 copy of the parameter
        assert ("addmm:mat1", True) in _sketchable_ops(lambda: lin(x.detach() * 2))


def test_products_of_two_activations_are_not_sketchable():
    a, b = torch.randn(3, 8, 16, requires_grad=True), torch.randn(3, 16, 8, requires_grad=True)
    saves = _sketchable_ops(lambda: torch.softmax(a @ b, -1) @ b.transpose(1, 2))
    assert sorted(s for s, _ in saves if s.startswith("bmm")) == ["bmm", "bmm", "bmm:mat2", "bmm:mat2"]
    assert not any(ok for _, ok in saves)


class _HandAttention(nn.Module):
    """q k^T and p v as matmuls of activations, as many models write them."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        p = torch.softmax(q @ k.transpose(-2, -1) / 4, -1)
        return self.out(p @ v)


class _WeightedAttention(nn.Module):
    """Multi-head attention asked for its weights: bmm of activations and a softmax, not the fused kernel."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=True)[0]


@pytest.mark.parametrize(
    "make, linear_inputs",
    [
        # the packed q/k/v projection (mm of the weight), the output projection, the two feed-forward layers
        (lambda: nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True), 4),
        (_WeightedAttention, 2),
        (_HandAttention, 2),
    ],
    ids=["encoder-layer", "mha-weights", "hand-written"],
)
def test_in_attention_only_the_projection_and_feed_forward_inputs_are_sketchable(make, linear_inputs):
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 6, 16, requires_grad=True)
    saves = _sketchable_ops(lambda: model(x))
    sketched = [s for s, ok in saves if ok]
    assert len(sketched) == linear_inputs and set(sketched) <= {"addmm:mat1", "mm"}, saves
    # attention's products of activations, its fused kernel, layer norms and activations are not
    others = [s for s, _ in saves if s.startswith(("bmm", "_scaled_dot", "native_layer_norm", "relu", "_softmax"))]
    assert others and not any(ok for s, ok in saves if s in others)


def test_convolution_and_normalisation_inputs_are_not_sketchable():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LayerNorm(4 * 36), nn.Linear(144, 3))
    saves = _sketchable_ops(lambda: model(torch.randn(2, 3, 8, 8, requires_grad=True)))
    assert [s for s, ok in saves if ok] == ["addmm:mat1"], saves


def test_the_controller_learns_the_flag_with_the_slot():
    model, x = Block(), torch.randn(64, 32)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    for _ in range(2):  # watched, then learned
        _step(model, controller, x)
        learned = {str(site): site for site in controller.sites.values()}
        assert sketchable(learned["addmm:mat1"]) and not sketchable(learned["relu"])


class CTCHead(nn.Module):
    """A loss inside the forward whose composite op saves more copies of its integer arguments when watched."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 12)

    def forward(self, x, targets):
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)  # (time, batch, classes)
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, targets, lengths, torch.full((x.shape[0],), targets.shape[1]))


def test_a_save_whose_index_shifts_after_the_watched_pass_keeps_its_rule():
    """CTC's log-alpha table (-inf where a path is impossible) is saved at another index once the watcher is off:
    it is still recognised, and kept, in every pass (rounded, it makes the gradient NaN)."""
    torch.manual_seed(0)
    model, x = CTCHead(), torch.randn(2, 40, 16)
    targets = torch.randint(1, 12, (2, 6))
    controller = gactx.Controller(model, level="L1.1", min_numel=0)
    with controller:
        for _ in range(3):
            model.zero_grad()
            model(x, targets).backward()
            alpha = [r for r in controller.records if r.dtype == torch.float32 and len(r.key.shape) == 3 and not r.op]
            assert not alpha, [(r.key, r.bits) for r in alpha]
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert not controller.diagnostics()["watch_next"]


def _gpt2(attention):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation=attention)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize(
    "make", [lambda: _gpt2("sdpa"), lambda: _gpt2("eager"), _llama], ids=["gpt2-sdpa", "gpt2-eager", "llama"]
)
def test_the_watched_first_step_stores_what_later_steps_store(make):
    """The loss's log_softmax result is kept as is, and nll_loss saves the same tensor as its input: in a watched
    pass both saves wait for the next op, and the second must find the first kept, as it does unwatched."""
    model, run = make()
    stats = []
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(3):
            torch.manual_seed(1)
            run().backward()
            stats.append(controller.memory_stats())
    assert stats[0] == stats[1] == stats[2]
    assert stats[0].deduplicated >= 1


class Rotary(nn.Module):
    """Rotary embeddings as decoders apply them: the query times cos and sin of shape (1, 1, T, D), broadcast over
    the batch and the heads; ``gate``: the result times the query, a product of two tensors of one shape."""

    def __init__(self, dim: int = 16, gate: bool = False):
        super().__init__()
        self.gate = gate
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, q):
        freqs = torch.arange(q.shape[-2], dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)[None, None]
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), -1)
        out = q * emb.cos() + rotated * emb.sin()
        return out * q if self.gate else out


def test_a_broadcast_factor_of_a_product_is_kept():
    """Backward multiplies the query's whole gradient by cos and sin: they are kept, and that gradient is exact."""
    torch.manual_seed(0)
    model, q = Rotary(), torch.randn(2, 4, 32, 16, requires_grad=True)
    (expected,) = torch.autograd.grad(model(q).sum(), q)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    with controller:
        (got,) = torch.autograd.grad(model(q).sum(), q)
    factors = [r for r in controller.records if r.cls == "broadcast factor"]
    assert len(factors) == 2 and all(not r.compressed and r.key.shape == (1, 1, 32, 16) for r in factors), (
        controller.report()
    )
    assert torch.equal(got, expected)


def test_a_product_of_two_tensors_of_one_shape_saves_each_as_linear():
    model, q = Rotary(gate=True), torch.randn(2, 4, 32, 16, requires_grad=True)
    controller = gactx.Controller(model, level="L1", min_numel=0)
    with controller:
        model(q).sum().backward()
    sites = _sites(controller)
    assert sites.count(("mul", "linear")) == 1 and sites.count(("mul:other", "linear")) == 1, sites
    assert sites.count(("mul:other", "broadcast factor")) == 2, sites
