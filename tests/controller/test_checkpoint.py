"""Non-reentrant activation checkpointing under gactx: the regions' inputs stored at ``checkpoint_bits``, what the
recomputation saves held compressed until backward reads it, torch's own behaviour wherever gactx's hooks are not in
scope."""

import gc

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

import gactx
from gactx.controller import checkpoint as gactx_checkpoint

pytestmark = pytest.mark.skipif(not gactx_checkpoint.supported(), reason="this torch's checkpoint is not followed")

WIDTH, ROWS, BLOCKS = 256, 512, 4


class Blocks(nn.Module):
    """Residual MLP blocks, each checkpointed (non-reentrant) when ``checkpointed``; ``context_fn``: a selective
    checkpointing policy's contexts."""

    def __init__(self, checkpointed: bool = True, context_fn=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(BLOCKS)
        )
        self.head = nn.Linear(WIDTH, 8)
        self.checkpointed, self.context_fn = checkpointed, context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed:
                kwargs = {} if self.context_fn is None else {"context_fn": self.context_fn}
                x = x + checkpoint(block, x, use_reentrant=False, **kwargs)
            else:
                x = x + block(x)
        return self.head(x)


def _model(**kwargs) -> Blocks:
    torch.manual_seed(0)
    return Blocks(**kwargs)


def _input(rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(1))


def _gradient(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def test_at_L0_gradients_are_bit_identical_to_plain_checkpointing():
    model, x = _model(), _input()
    plain = _gradient(model, x)
    with gactx.Controller(model, level="L0"):
        _gradient(model, x)
        assert torch.equal(_gradient(model, x), plain)


def test_region_inputs_are_stored_at_checkpoint_bits_and_recomputed_saves_compressed():
    model, x = _model(), _input()
    plain = _gradient(model, x)
    with gactx.Controller(model, level="L1.1") as controller:
        _gradient(model, x)
        got = _gradient(model, x)
        inputs = [r for r in controller.records if r.cls == "checkpoint input"]
        recomputed = controller.memory_stats(backward=True)
    assert len(inputs) == BLOCKS and all(r.bits == 8 for r in inputs)
    assert all(r.packed_bytes < r.original_bytes / 3 for r in inputs)
    # Each block's recomputation saves its LayerNorm, linear and GELU inputs: held compressed until backward reads them.
    assert recomputed.compressed >= 3 * BLOCKS and recomputed.packed_bytes < recomputed.original_bytes / 2
    assert _cosine(got, plain) > 0.9999


def test_checkpoint_bits_none_keeps_the_region_inputs():
    model, x = _model(), _input()
    with gactx.Controller(model, level="L1", checkpoint_bits=None) as controller:
        _gradient(model, x)
        _gradient(model, x)
        inputs = [r for r in controller.records if r.cls == "checkpoint input"]
    assert len(inputs) == BLOCKS
    assert all(r.reason == "checkpoint_bits=None" and r.packed_bytes == r.original_bytes for r in inputs)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_each_checkpoint_width_trains_close_to_plain(bits):
    model, x = _model(), _input()
    plain = _gradient(model, x)
    with gactx.Controller(model, level="L1.1", checkpoint_bits=bits) as controller:
        _gradient(model, x)
        got = _gradient(model, x)
        widths = {r.bits for r in controller.records if r.cls == "checkpoint input"}
    assert widths == {bits}  # float32 at 16 bits: bfloat16 with stochastic rounding
    assert _cosine(got, plain) > {2: 0.95, 4: 0.995}.get(bits, 0.999)  # measured: 0.974 at 2 bits, 0.9987 at 4


def test_checkpointing_with_gactx_lowers_the_allocators_peak():
    """The profiler's peak of a step, gradients set to none: checkpointing alone against checkpointing under L1, at a
    batch where a block's recomputed activations, not the parameters' gradients, are what the step holds."""
    model, x = _model(), _input(4 * ROWS)

    def peak() -> int:
        _gradient(model, x)
        model.zero_grad(set_to_none=True)
        with gactx.PeakMemory("cpu") as meter:
            model(x).square().mean().backward()
        return meter.peak

    alone = peak()
    with gactx.Controller(model, level="L1"):
        compressed = peak()
    # Measured 0.93: a block's backward holds its decoded operands and their gradients, at full width either way.
    assert compressed < 0.95 * alone


def test_a_region_holds_its_last_recomputed_save_only_until_backward_reads_it():
    """The recomputation stops early at the region's last save (torch raises from its pack hook): that save's codes
    are then the dictionary's alone, freed once backward has read them, not held for the rest of the region's
    backward. Checked between the last Linear's backward and the GELU's, while the region's frame is alive."""
    model, x = _model(), _input()
    held = []

    def look(grad: torch.Tensor) -> None:
        stores = [o for o in gc.get_objects() if type(o) is gactx_checkpoint.Recomputed]  # not isinstance: proxies
        held.append((len(stores), sum(s.last is not None for s in stores)))

    def watch(module, args, output) -> None:
        if output.requires_grad:
            output.register_hook(look)

    handles = [block[2].register_forward_hook(watch) for block in model.blocks]
    try:
        with gactx.Controller(model, level="L1"):
            _gradient(model, x)
    finally:
        for handle in handles:
            handle.remove()
    assert len(held) >= BLOCKS and all(stores >= 1 for stores, _ in held)
    assert all(last == 0 for _, last in held), held


def test_selective_checkpointing_policies_work_under_gactx():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):  # keep the matrix products, recompute the rest
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    model, x = _model(context_fn=lambda: create_selective_checkpoint_contexts(policy)), _input()
    plain = _gradient(model, x)
    with gactx.Controller(model, level="L1.1"):
        _gradient(model, x)
        assert _cosine(_gradient(model, x), plain) > 0.9999


def test_reentrant_checkpointing_stays_as_it_was():
    """A reentrant checkpoint's inputs are a custom function's saved tensors and its recomputation an ordinary forward
    in backward: no frame of torch's, no checkpoint input class."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
    x = _input().requires_grad_()
    with gactx.Controller(block, level="L1.1") as controller:
        for _ in range(2):
            checkpoint(block, x, use_reentrant=True).sum().backward()
        assert not [r for r in controller.records if r.cls == "checkpoint input"]
        assert controller.memory_stats(backward=True).compressed > 0


def test_torch_classes_are_replaced_while_installed_and_restored_after():
    frame, recomputation = torch_checkpoint._CheckpointFrame, torch_checkpoint._recomputation_hook
    a, b = _model(), _model()
    with gactx.Controller(a, level="L1"):
        assert torch_checkpoint._CheckpointFrame is gactx_checkpoint.Frame
        with gactx.Controller(b, level="L1"):
            pass
        assert torch_checkpoint._CheckpointFrame is gactx_checkpoint.Frame  # another controller still installed
    assert torch_checkpoint._CheckpointFrame is frame
    assert torch_checkpoint._recomputation_hook is recomputation


def test_checkpoints_under_other_hooks_are_torchs_own():
    """A checkpoint whose region begins under other saved-tensor hooks than gactx's (PyTorch's save_on_cpu inside a
    controller) is torch's own: nothing of it reaches gactx."""
    model, x = _model(), _input()
    plain = _gradient(model, x)
    with gactx.Controller(model, level="L1") as controller:
        with torch.autograd.graph.save_on_cpu():
            got = _gradient(model, x)
        assert torch.equal(got, plain)
        assert controller.memory_stats().tensors == 0 and controller.memory_stats(backward=True).tensors == 0


@pytest.mark.parametrize("value", [3, 32, 8.0, "8", True])
def test_checkpoint_bits_is_checked(value):
    with pytest.raises(ValueError, match="checkpoint_bits"):
        gactx.Config(checkpoint_bits=value)


def test_hugging_face_gradient_checkpointing_compresses_the_layer_inputs():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))

    def gradient() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain = gradient()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with gactx.Controller(model, level="L1.1") as controller:
        gradient()
        got = gradient()
        inputs = [r for r in controller.records if r.cls == "checkpoint input"]
        assert controller.memory_stats(backward=True).compressed > 0
    assert len(inputs) == config.num_hidden_layers and all(r.bits == 8 for r in inputs)
    assert _cosine(got, plain) > 0.999


def test_checkpointed_regions_of_a_compiled_model_train_close_to_plain():
    """Under torch.compile a checkpoint is a region the partitioner recomputes: what the graph saves across it goes
    through gactx's compiled hooks, as a compiled graph's other saves (at the level's width)."""
    model, x = _model(), _input()
    plain = _gradient(model, x)
    compiled = torch.compile(model)
    with gactx.Controller(model, level="L1.1") as controller:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            compiled(x).square().mean().backward()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert any(r.compressed for r in controller.records)
    assert _cosine(got, plain) > 0.9999


def test_checkpoints_in_another_thread_are_torchs_own():
    """Saved-tensor hooks belong to the thread that installed them: a checkpointed step in another thread, while a
    controller is installed here, begins under no gactx hooks and runs as torch's own."""
    import threading

    model, x = _model(), _input()
    plain = _gradient(model, x)
    got = {}
    with gactx.Controller(model, level="L1") as controller:
        worker = threading.Thread(target=lambda: got.update(gradient=_gradient(model, x)))
        worker.start()
        worker.join()
        assert controller.memory_stats(backward=True).tensors == 0
    assert torch.equal(got["gradient"], plain)
