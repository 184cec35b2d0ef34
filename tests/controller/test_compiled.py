"""gactx/controller/compiled.py: saved tensors compressed inside compiled graphs.

Most tests compile with AOTAutograd and run its graphs eagerly (``backend="aot_eager"``): the hooks are
inlined the same way, in seconds. One test runs Inductor, what users run.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gactx
from gactx.controller.compiled import INLINE, HookGraph
from gactx.controller.graph_nodes import constant_nodes, module_name
from gactx.controller.pack import PackPath
from gactx.kernels import cpu

WIDTH = 128

# Compressing inside compiled graphs needs torch 2.10 or later (compiled.INLINE); an older torch's fallback:
# test_compiled_fallback.py.
pytestmark = pytest.mark.skipif(not INLINE, reason="compiled graphs' saves are compressed from torch 2.10 on")


def mlp(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(blocks)])


class Attention(nn.Module):
    """Softmax attention of ``x`` over itself; ``masked``: a leaky ReLU by ``where`` (a bool mask saved)."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.qk = nn.Linear(WIDTH, 2 * WIDTH)
        self.masked = masked

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        h = torch.softmax(q @ k.transpose(-1, -2), -1) @ x
        return torch.where(h > 0, h, h.detach() * 0.1) if self.masked else h


class Leaky(nn.Module):
    """A leaky ReLU by ``where``: a bool mask saved."""

    def forward(self, h):
        return torch.where(h > 0, h, h.detach() * 0.1)


def grads(module, model, x) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    (module(x) * 0.01).sum().backward()  # a loss that saves nothing outside the model
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_pack_hook_runs_only_while_compiling(monkeypatch):
    model, x = mlp(), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    calls = []
    eager_pack = PackPath.pack
    monkeypatch.setattr(PackPath, "pack", lambda path, t: calls.append(t.shape) or eager_pack(path, t))
    with gactx.Controller(model, level="L1.1") as controller:
        for _ in range(3):
            grads(compiled, model, x)
    assert calls == [], "a compiled model's saves go through the graph, not the eager hook"
    stats = controller.memory_stats()
    # The graph saves its input, each linear's output (GELU's input) and each GELU's output but the last.
    assert stats.compressed == 6 and stats.kept == 0
    assert stats.original_bytes == 6 * 64 * WIDTH * 4
    assert 3.5 < stats.ratio < 4.0


def test_records_name_the_modules_and_do_not_grow():
    model, x = mlp(), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    with gactx.Controller(model, level="L1.2") as controller:
        grads(compiled, model, x)
        first = controller.memory_stats()
        for _ in range(3):
            grads(compiled, model, x)
    assert controller.memory_stats() == first
    keys = [str(r.key) for r in controller.records]
    assert keys == ["0.0[0]", "0.0[1]", "0.1[0]", "1.0[0]", "1.1[0]", "2.0[0]"]
    report = controller.report()
    assert "0.1[0]" in report and "input" in report and "addmm" in report and "gelu" in report


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "compiled module"])
def test_a_compiled_root_begins_and_ends_its_passes(wrapped):
    """The whole model compiled (no eager module of it runs): evaluations under ``no_grad`` in between, a forward
    abandoned before its backward, and the adaptation's own passes leave the training pass's statistics and
    widths as they were, and nothing grows; the controller may be given the model or the compiled module."""
    model, x = mlp(), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    controller = gactx.Controller(compiled if wrapped else model, level="L2.2", adapt_interval=2)

    def backprop():
        grads(compiled, model, x[:16])

    with controller:
        seen = []
        for step in range(6):
            grads(compiled, model, x)
            controller.iterate(backprop)
            with torch.no_grad():
                compiled(x)
            if step == 3:
                compiled(x[:8]).sum()  # never run backward
            grads(compiled, model, x)
            stats = controller.memory_stats()
            seen.append((stats, [(str(r.key), r.bits) for r in controller.records], controller.diagnostics()["keys"]))
    assert controller.allocation, "the adaptation allocated widths to the compiled model's tensors"
    (stats, records, keys), *rest = seen[1:]  # after the first adaptation
    assert stats.tensors == 6 and stats.original_bytes == 6 * 64 * WIDTH * 4
    assert any(bits != 4 for _, bits in records), "the allocation reaches the compiled saves"
    for later in rest:
        assert later[0].tensors == 6 and later[0].original_bytes == stats.original_bytes
        assert [k for k, _ in later[1]] == [k for k, _ in records]
        assert later[2] <= keys + 8, "keys do not grow with the steps"


def test_gradients_as_close_as_eager_and_l0_exact():
    model, x = mlp(), torch.randn(256, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    full = grads(model, model, x)
    plain = grads(compiled, model, x)
    with gactx.Controller(model, level="L0"):
        assert torch.equal(grads(compiled, model, x), plain), "L0 changes nothing in a compiled graph"
    for level in ("L1.1", "L1.2"):
        with gactx.Controller(model, level=level):
            eager = torch.stack([grads(model, model, x) for _ in range(4)]).mean(0)
            comp = torch.stack([grads(compiled, model, x) for _ in range(4)]).mean(0)
        cos_eager, cos_comp = F.cosine_similarity(eager, full, 0), F.cosine_similarity(comp, full, 0)
        assert cos_comp >= cos_eager - 0.01, (level, cos_comp, cos_eager)


def test_deterministic_bytes_are_the_eager_quantizers():
    """Linear layers only: eager and compiled both store each linear's input quantized at 4 bits, and with
    stochastic=False the codes are the same, so the gradients are. (The first layer's input, which the test
    holds, eager reads where it lives.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1))
    x = torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    with gactx.Controller(model, level="L1", stochastic=False, backend="torch"):
        eager, comp = grads(model, model, x)[WIDTH * WIDTH :], grads(compiled, model, x)[WIDTH * WIDTH :]
    full = grads(model, model, x)[WIDTH * WIDTH :]
    assert not torch.equal(eager, full), "the inputs were quantized"
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # Inductor's C++ wrapper compiles each graph with the C++ compiler: about 30 s here
@pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")
def test_inductors_cpp_wrapper_calls_the_ops_from_its_own_code():
    """``torch.compile(model, options={"cpp_wrapper": True})``: the graph's C++ code calls gactx's ops (their schemas
    as C++ boxes them: ints, a dtype's index, a shape's SymInts), static shapes and then dynamic ones (a second batch
    size), with the records at the shapes that ran and the gradients as close as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.2), nn.Linear(WIDTH, 8)).eval()
    compiled = torch.compile(model, options={"cpp_wrapper": True})
    controller = gactx.Controller(model, level="L1", stochastic=False)
    for batch in (32, 48):  # the second: recompiled with a dynamic batch (a size guard failed)
        x = torch.randn(batch, WIDTH)
        full = grads(model, model, x)
        with controller:
            eager, comp = grads(model, model, x), grads(compiled, model, x)
            records = [r for r in controller.records if r.compressed]
            assert torch.equal(grads(compiled, model, x), comp), "deterministic rounding: the same codes each step"
        assert len(records) == 3 and all(r.key.shape[0] == batch for r in records)
        assert F.cosine_similarity(comp, full, 0) > F.cosine_similarity(eager, full, 0) - 0.001 > 0.99


@pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")
def test_inductors_python_wrapper_calls_the_cpu_ops_past_the_dispatcher(monkeypatch):
    """Inductor's Python code calls the ops of CPU saves (codes and a bool mask, and their decoding) as the
    extension's own functions (``cpu.DIRECT``), through ``torch.ops`` with it off: the same records, and with
    deterministic rounding the same gradients; the results' size checks only through ``torch.ops``."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache  # the FX graph cache left out
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Leaky(), nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(64, WIDTH)
    seen = {}
    for direct in (True, False):
        monkeypatch.setattr(cpu, "DIRECT", direct)
        torch._dynamo.reset()
        compiled = torch.compile(model)
        with gactx.Controller(model, level="L1", stochastic=False, min_numel=4096) as controller, fresh():
            g, code = utils.run_and_get_code(grads, compiled, model, x)
            assert torch.equal(grads(compiled, model, x), g)
            records = [(r.cls, r.bits, r.packed_bytes) for r in controller.records]
        code = "\n".join(code)
        seen[direct] = g, records
        for op in ("quantize_saved", "dequantize_saved", "pack_bool_saved"):
            calls = code.count(f"_gactx_cpu.{op}("), code.count(f"torch.ops.gactx_cpu.{op}.default(")
            assert calls[0 if direct else 1] > 0 and calls[1 if direct else 0] == 0, (op, direct, calls)
            # Inductor's checks of an op's result (cpu.ASSERTS): kept through torch.ops, where the results match
            checked = f"'torch.ops.gactx_cpu.{op}.default')"
            assert (checked in code) != direct, (op, direct)
    assert torch.equal(seen[True][0], seen[False][0]) and seen[True][1] == seen[False][1]
    assert [cls for cls, _, _ in seen[True][1]] == ["linear", "bool mask", "linear", ""]  # the last: kept, small


def test_noise_is_new_every_step_without_recompiling():
    from torch._dynamo.utils import counters

    counters.clear()
    model, x = mlp(), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    with gactx.Controller(model, level="L1.2"):
        a, b = grads(compiled, model, x), grads(compiled, model, x)
    assert not torch.equal(a, b), "each step draws new noise"
    assert counters["stats"]["unique_graphs"] == 1
    with gactx.Controller(model, level="L1.2", stochastic=False):
        assert torch.equal(grads(compiled, model, x), grads(compiled, model, x))


def test_bool_masks_attention_and_small_tensors():
    torch.manual_seed(0)
    model = Attention(masked=True)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 32, WIDTH)
    with gactx.Controller(model, level="L1.2", min_numel=1024) as controller:
        grads(compiled, model, x)
    records = controller.records
    by_cls = {r.cls: r for r in records}
    assert by_cls["attention"].bits == 4, "softmax results get at least 4 bits"
    assert by_cls["bool mask"].bits == 1
    assert by_cls["bool mask"].packed_bytes == 4 * 32 * WIDTH // 8
    assert all(r.compressed for r in records if r.original_bytes >= 4096)


def test_dynamic_shapes_are_compressed():
    model = mlp(2)
    compiled = torch.compile(model, backend="aot_eager")
    with gactx.Controller(model, level="L1.1") as controller:
        for batch in (64, 32, 48):
            x = torch.randn(batch, WIDTH)
            full = grads(model, model, x)
            comp = grads(compiled, model, x)
            assert F.cosine_similarity(comp, full, 0) > 0.999
            stats = controller.memory_stats()
            assert stats.original_bytes == 4 * batch * WIDTH * 4 and stats.compressed == 4


def test_regional_compilation_names_each_call():
    model = mlp(3)
    for block in model:
        block.forward = torch.compile(block.forward, backend="aot_eager")
    x = torch.randn(64, WIDTH)
    with gactx.Controller(model, level="L1.1") as controller:
        for _ in range(2):
            grads(model, model, x)
    keys = [str(r.key) for r in controller.records]
    # Each block's graph saves its input (the activation the block before made) and its linear's output,
    # named as eager saves are.
    assert keys == ["0.0[0]", "0.0[1]", "1.0[0]", "1.0[1]", "2.0[0]", "2.0[1]"]
    assert controller.memory_stats().compressed == 6


def test_new_allocation_recompiles_once():
    from torch._dynamo.utils import counters

    counters.clear()
    model, x = mlp(), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")

    def backprop():
        compiled(x).square().mean().backward()

    # The allocation of the compiled graph's saves each training step ran under. The estimator's closure also saves
    # outside the graph (``square``'s input, in eager code): an adaptation that changes only that save's width leaves
    # the graph as it was, so it is not counted.
    in_force = []
    with gactx.Controller(model, level="L2.2", adapt_interval=2) as controller:
        for _ in range(5):
            before = controller.allocation  # empty before the first adaptation: every save at the level's bits
            grads(compiled, model, x)
            in_graph = sorted({r.key.slot for r in controller.records})
            in_force.append(tuple(before.get(slot, controller.config.bits) for slot in in_graph))
            controller.iterate(backprop)  # adapts after steps 1, 2 and 4
    allocations = 1 + sum(a != b for a, b in zip(in_force, in_force[1:], strict=False))
    assert controller.last_adaptation is not None and allocations >= 2
    # One graph for each allocation training ran under in turn, and none for the estimator's passes. Whether a later
    # adaptation keeps the widths is the estimate's to say; the graphs follow it.
    assert counters["stats"]["unique_graphs"] == allocations
    widths = {r.bits for r in controller.records if r.compressed}
    assert widths <= {1, 2, 4, 8} and widths != {2}, widths


def test_installing_again_reuses_the_compiled_graphs():
    """torch.compile guards on a module's hooks: installed again, a controller's module hooks are the ones it had,
    under the same ids, so a model evaluated plainly between installations (``uninstall_hook``, a ``with`` block a
    step) keeps one graph with gactx's hooks and one without, and never reaches TorchDynamo's recompile limit."""
    from torch._dynamo.utils import counters

    counters.clear()
    model, x = mlp(), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend="aot_eager")
    controller = gactx.Controller(model, level="L1")
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        with controller:
            grads(compiled, model, x)
            assert sum(r.compressed for r in controller.records) == 6  # each Linear's and GELU's input
        grads(compiled, model, x)
    assert counters["stats"]["unique_graphs"] == 2
    assert not any(model._forward_pre_hooks or model._forward_hooks for model in model.modules())


def _guards(compiled: nn.Module) -> int:
    """The guards TorchDynamo checks before a call of the module it compiled last, ``compiled`` or another: the lines
    of the guard tree of the newest cache entry of the code that every ``torch.compile`` of a module runs."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(compiled.forward.__wrapped__.__code__)
    return str(entries[0].guard_manager).count("\n")


def test_the_module_trackers_hooks_add_few_guards_to_a_compiled_model():
    """TorchDynamo checks its guards before every call of a compiled model, hooks included: the tracker's two hook
    functions, the same on every module, add about 14 guards a module here (a partial of its own on each added 38:
    1325 against compiled plain's 379 on this MLP of 25 modules)."""
    x = torch.randn(64, WIDTH)
    plain = torch.compile(mlp(8), backend="aot_eager")
    plain(x).sum().backward()
    plain_guards = _guards(plain)
    model = mlp(8)
    compiled = torch.compile(model, backend="aot_eager")
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(2):
            compiled(x).sum().backward()
        assert sum(r.compressed for r in controller.records) == 16  # every Linear's and GELU's input
        assert _guards(compiled) - plain_guards <= 20 * len(list(model.modules()))


def test_inductor_compiles_and_fuses_the_format():
    """What users run: Inductor generates the quantize and dequantize code; gradients match eager's."""
    model, x = mlp(1), torch.randn(64, WIDTH)
    compiled = torch.compile(model)
    full = grads(model, model, x)
    with gactx.Controller(model, level="L1.1") as controller:
        comp = grads(compiled, model, x)
    assert controller.memory_stats().compressed == 2  # the input and the linear's output
    assert F.cosine_similarity(comp, full, 0) > 0.9999


def test_hooks_are_graph_modules_that_bypass_the_compile_caches():
    model = mlp(1)
    controller = gactx.Controller(model, level="L1")
    with controller:
        pack, unpack = controller.hooks
    assert isinstance(pack, HookGraph) and isinstance(unpack, HookGraph)
    targets = [n.target.__name__ for n in pack.graph.nodes if n.op == "call_function"]
    assert targets == ["_uncached"]


@pytest.mark.parametrize(
    "path, name",
    [("L['self'].blocks[0].attn", "blocks.0.attn"), ("L['fn'].0.1", "0.1"), ("L['self']", ""),
     ("L['self']._modules['layer'].fc", "layer.fc"), ("L['args'][0].model.layers.0", "model.layers.0")],
)  # fmt: skip
def test_module_names(path, name):
    assert module_name(path) == name


def _traced_graphs(**options) -> tuple[list, list]:
    """The nodes of the forward and backward graphs AOTAutograd hands its compilers for a 3-block MLP under a controller
    of ``options``, after one step."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.graph
            return gm

        return compiler

    model, x = mlp(3), torch.randn(64, WIDTH)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    with gactx.Controller(model, **options):
        grads(compiled, model, x)
    return list(graphs["fw"].nodes), list(graphs["bw"].nodes)


def test_pack_nodes_follow_what_they_read_and_unpack_nodes_precede_their_use():
    fw, bw = _traced_graphs(level="L1.1")
    quantize = [n for n in fw if n.target is torch.ops.gactx_cpu.quantize_saved.default]  # CPU tensors: the C++ ops
    assert len(quantize) >= 6
    for q in quantize:
        source = q.args[0]  # the saved tensor
        while source.op == "call_function" and "view" in str(source.target):
            source = source.args[0]
        between = fw[fw.index(source) + 1 : fw.index(q)]
        pack = ("gactx", "view")  # (an input's pack nodes come after the other inputs)
        assert all(n.op == "placeholder" or any(p in str(n.target) for p in pack) for n in between), between
    last_addmm = max(i for i, n in enumerate(fw) if "addmm" in str(n.target))
    assert fw.index(quantize[0]) < last_addmm, "packs run during the forward, not after it"
    dequantize = [n for n in bw if n.target is torch.ops.gactx_cpu.dequantize_saved.default]
    assert len(dequantize) == len(quantize)
    for d in dequantize[:-1]:  # the last save's stays first: backward uses it first
        user = min(bw.index(u) for v in (d, *d.users) for u in v.users if "gactx" not in str(u.target))
        assert user - bw.index(d) <= 3, "decoded right before its first use"


def test_decodings_in_torch_ops_are_moved_whole_to_their_first_use():
    """With ``backend="torch"`` a save is decoded by traced ops, among them constants made from nothing (the
    ``arange`` of the planes' shifts) that the decoding's later nodes read: those are moved with the rest of the
    decoding to right before its first use, not left at the start of the backward graph, where every save would be
    decoded before backward begins."""
    _, bw = _traced_graphs(level="L1", backend="torch")
    constants = constant_nodes(bw)
    saves = sorted({n.name.rsplit("_hook_", 1)[0] for n in bw if n.op == "placeholder" and "_hook_" in n.name})
    assert len(saves) >= 6
    decoded = []
    for name in saves:
        block = {n for n in bw if n.op == "placeholder" and n.name.startswith(f"{name}_hook_")}
        for n in bw:
            made_of = n.all_input_nodes
            if n.op == "call_function" and n not in constants and all(a in block or a in constants for a in made_of):
                block.add(n)
        decoding = sorted(bw.index(n) for n in block if n.op == "call_function")
        if len(decoding) < 10:  # the ticks' counts, a save kept as it is
            continue
        first_use = min(bw.index(u) for n in block for u in n.users if u not in block)
        decoded.append((decoding[0], first_use == decoding[-1] + 1 and decoding[-1] - decoding[0] < 100, name))
    # the last save's decoding stays first (backward uses it first); every other one ends right before its first use
    decoded.sort()
    assert len(decoded) >= 6 and all(right for _, right, _ in decoded[1:]), decoded


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_an_rmsnorm_input_is_compressed_as_eager_compresses_it():
    """The backward of ``x.pow(2)`` reads ``x`` linearly (``pow(x, 1)`` in the graph): the input is quantized as in
    eager mode, not kept as a log-domain value; the ``rsqrt`` result stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), RMSNorm(), nn.Linear(WIDTH, 8))
    x = torch.randn(64, WIDTH)
    plain = grads(model, model, x)
    compiled = torch.compile(model, backend="aot_eager")
    with gactx.Controller(model, level="L1") as controller:
        got = grads(compiled, model, x)
        made = {r.op: r for r in controller.records if r.key.module == "0"}
    assert made["addmm"].compressed and made["addmm"].cls == "linear", made
    assert F.cosine_similarity(got, plain, dim=0) > 0.99


def test_values_that_backward_feeds_to_exp_are_attention_logits():
    """Inductor's partitioner recomputes a softmax in backward from its saved scores: noise in the scores is
    multiplied by the exp, so they get the width of attention logits (at least 8 bits), as a fused attention's query
    and key do."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    model = Attention()

    def nop(gm, example_inputs):
        return gm

    from torch._inductor.decomposition import select_decomp_table

    backend = aot_autograd(  # Inductor's decompositions and partitioner, its graphs run as they are
        fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )  # fmt: skip
    compiled = torch.compile(model, backend=backend)
    with gactx.Controller(model, level="L1.2") as controller:
        grads(compiled, model, torch.randn(4, 32, WIDTH))
    scores = [r for r in controller.records if r.key.shape == (4, 32, 32)]
    assert scores and all(r.cls == "attention logits" and r.bits == 8 for r in scores), controller.report()


class FusedAttention(nn.Module):
    """Attention through ``F.scaled_dot_product_attention`` (a fused op that a graph keeps whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (4, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def test_a_fused_attentions_query_and_key_are_attention_logits():
    """Its backward recomputes the probabilities from the stored query and key with the exact logsumexp: at least
    8 bits, as in eager mode; its value and output are attention (at least 4 bits)."""
    torch.manual_seed(0)
    model = FusedAttention()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 32, WIDTH)
    with gactx.Controller(model, level="L1", min_numel=0) as controller:
        grads(compiled, model, x)
    widths = {r.cls: r.bits for r in controller.records if r.compressed}
    assert widths.get("attention logits") == 8 and widths.get("linear") == 4, controller.report()
    assert widths.get("attention") == 4, controller.report()
    assert sum(r.cls == "attention logits" for r in controller.records) == 2, controller.report()
    assert sum(r.cls == "attention" for r in controller.records) == 2, controller.report()


class Normed(nn.Module):
    """Linear layers each followed by a LayerNorm: every LayerNorm saves its rows' mean and inverse deviation, small
    tensors kept as they are."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(blocks)]
        self.blocks = nn.Sequential(*layers)

    def forward(self, x):
        return self.blocks(x)


def _compiled_step(level: str, backend: str, op: str, monkeypatch) -> tuple:
    """Two steps of a compiled ``Normed``, then a third counted: the calls of ``op``, the records, the statistics, the
    gradient, and the saves the C++ ops logged in that step."""
    from gactx.kernels import cpu

    model, x = Normed(), torch.randn(64, WIDTH)
    run = torch.compile(model, backend="aot_eager")
    logged, drain = [], cpu.drain_log

    def counted() -> list[int]:
        log, i = drain(), 0
        while i < len(log):  # entries: kind (0 a save ran), token, rank, then rank sizes
            logged.append(log[i] == 0)
            i += 3 + (log[i + 2] if log[i] == 0 else 0)
        return log

    monkeypatch.setattr(cpu, "drain_log", counted)
    with gactx.Controller(model, level=level, min_numel=1024, backend=backend) as controller:
        for _ in range(2):
            grads(run, model, x)
        controller.records  # noqa: B018  (the log of those steps read)
        logged.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            g = grads(run, model, x)
        ops = sum(e.count for e in prof.key_averages() if e.key == op)
        records = sorted((str(r.key), r.bits, r.reason, r.original_bytes, r.packed_bytes) for r in controller.records)
        return ops, records, controller.memory_stats(), g, sum(logged)


# The C++ ops of CPU tensors (a kept save's op logs it), and the torch ops with their Python tick (the path of
# every other device: a kept save's tick calls the controller).
@pytest.mark.parametrize("backend, op", [("auto", "gactx_cpu::keep_saved"), ("torch", "gactx::tick")])
@pytest.mark.parametrize("level", ["L0", "L1"])
def test_a_graphs_kept_saves_share_one_op_and_are_recorded_as_with_one_each(monkeypatch, level, backend, op):
    """A graph's saves of static shapes are recorded with its first one: a kept save with no op of its own, and
    (the C++ ops) a compressed save whose op logs nothing, so that one log entry a graph run is read."""
    from gactx.controller import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "FOLLOW", False)
    ops_each, records_each, stats_each, g_each, logged_each = _compiled_step(level, backend, op, monkeypatch)
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_module, "FOLLOW", True)
    ops_one, records_one, stats_one, g_one, logged_one = _compiled_step(level, backend, op, monkeypatch)

    kept = sum(1 for r in records_each if r[2])
    ticked = len(records_each) - kept if backend == "torch" else 0  # a compressed save's tick seeds its noise
    assert kept >= 6 and ops_each == kept + ticked, "one op each: the LayerNorms' statistics (and at L0 every save)"
    # The lead is the graph's first save that may lead: kept, or (the C++ ops) compressed, whose own op logs it (at
    # L1 the first Linear's input: then no kept save has an op)
    leads = ops_one - ticked
    assert leads == (0 if backend == "auto" and level == "L1" else 1)
    if backend == "auto":
        assert logged_each == len(records_each) and logged_one == 1, "one log entry a graph run"
    # The same records, less what each kept save but the lead held beside its tensor: the C++ op's one-byte marker,
    # the tick's 8-byte count.
    assert [r[:4] for r in records_one] == [r[:4] for r in records_each]
    marker = 1 if backend == "auto" else 8
    less = sorted(e[4] - o[4] for e, o in zip(records_each, records_one, strict=True))
    assert less == [0] * (len(records_each) - kept + leads) + [marker] * (kept - leads)
    held = marker * (kept - leads)
    markers = dataclasses.replace(stats_one, packed_bytes=stats_one.packed_bytes + held,
                                  kept_bytes=stats_one.kept_bytes + held, kept_by_reason={})  # fmt: skip
    assert markers == dataclasses.replace(stats_each, kept_by_reason={})
    assert stats_one.kept_by_reason.keys() == stats_each.kept_by_reason.keys()
    if level == "L0":
        assert torch.equal(g_one, g_each)


def test_a_kept_save_of_a_dynamic_shape_is_recorded_with_the_shape_it_runs_with():
    model = Normed(2)
    run = torch.compile(model, backend="aot_eager", dynamic=True)
    with gactx.Controller(model, level="L1", min_numel=1024) as controller:
        for batch in (64, 32, 48):
            grads(run, model, torch.randn(batch, WIDTH))
            kept = [r for r in controller.records if r.reason]
            assert kept and all(r.key.shape[0] == batch for r in kept if r.key.shape)


class Rotary(nn.Module):
    """A linear layer, then rotary embeddings: the projection times cos and sin of shape (1, T, D), broadcast over the
    batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, WIDTH, 2).float() / WIDTH), persistent=False)

    def forward(self, x):
        freqs = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)[None]
        q = self.lin(x)
        rotated = torch.cat((-q[..., WIDTH // 2 :], q[..., : WIDTH // 2]), -1)
        return q * emb.cos() + rotated * emb.sin()


def test_a_broadcast_factor_is_kept_in_a_graph_as_in_eager_mode():
    """Backward multiplies the projection's whole gradient by cos and sin: kept, as the eager rule has it. The graph
    saves the angles and recomputes cos and sin from them in backward."""
    torch.manual_seed(0)
    model = Rotary()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 32, WIDTH)
    with gactx.Controller(model, level="L1", min_numel=0) as controller:
        grads(compiled, model, x)
    factors = [r for r in controller.records if r.cls == "broadcast factor"]
    assert factors and all(not r.compressed and r.key.shape == (32, WIDTH) for r in factors), controller.report()
    assert any(r.cls == "linear" and r.compressed for r in controller.records), controller.report()
