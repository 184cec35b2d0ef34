"""benchmarks/llm.py: the Llama-style LoRA workload has Llama-3.2-1B's shape at full size, LoRA on every linear
layer, a learnable generated language, a short probe batch, and its own gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from benchmarks import llm  # noqa: E402

# Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings); LoRA r=16 on q, k, v, o, gate, up and down of each
# of 16 layers: 16 * 16 * ((2048+2048) * 2 + (2048+512) * 2 + (2048+8192) * 2 + (8192+2048)) = 11,272,192.
BASE, ADAPTERS = 1_235_814_400, 11_272_192


def test_full_size_is_llama_3_2_1b_with_lora_on_every_linear_layer():
    w = llm.build("full", "meta")
    trainable = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
    assert (trainable, sum(p.numel() for p in w.model.parameters())) == (ADAPTERS, BASE + ADAPTERS)
    assert len(w.blocks) == 16 and w.tokens == 4096 and w.default_batch == 1
    dtypes = {p.dtype for p in w.model.parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16} and {p.dtype for p in w.model.parameters() if p.requires_grad} == {torch.float32}


def test_the_generated_language_follows_its_successors_and_is_deterministic():
    w = llm.build("tiny")
    (ids,), target = w.make_batch(3, torch.Generator().manual_seed(1))
    (again,), _ = w.make_batch(3, torch.Generator().manual_seed(1))
    assert torch.equal(ids, again) and ids.shape == (3, llm.LLAMA_SIZES["tiny"].sequence)
    assert torch.equal(target, ids[:, 1:].flatten())
    # each token's successors: at most SUCCESSORS distinct next tokens anywhere in a long sample
    (long,), _ = w.make_batch(64, torch.Generator().manual_seed(2))
    pairs = {}
    for a, b in zip(long[:, :-1].flatten().tolist(), long[:, 1:].flatten().tolist(), strict=True):
        pairs.setdefault(a, set()).add(b)
    assert max(len(s) for s in pairs.values()) <= llm.SUCCESSORS


def test_the_loss_is_the_models_own_and_only_the_adapters_train():
    w = llm.build("tiny")
    inputs, target = w.make_batch(2, torch.Generator().manual_seed(0))
    loss = w.loss(w.model, inputs, target)
    logits = w.logits(w.model, inputs)
    assert logits.shape == (target.numel(), llm.LLAMA_SIZES["tiny"].vocab)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.float(), target))
    loss.backward()
    grads = {n for n, p in w.model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)


def test_the_probe_batch_is_one_short_sequence():
    w = llm.build("tiny")
    inputs, target = w.make_batch(2, torch.Generator().manual_seed(0))
    (probe,), probe_target = w.sub_batch(inputs, target)
    assert probe.shape == (1, min(llm.PROBE_TOKENS, inputs[0].shape[1]))
    assert torch.equal(probe, inputs[0][:1, : probe.shape[1]]) and torch.equal(probe_target, probe[:, 1:].flatten())


def test_checkpointing_on_and_off_keeps_loss_and_gradients():
    w = llm.build("tiny")
    for module in w.model.modules():  # no dropout: both runs see the same forward
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    inputs, target = w.make_batch(2, torch.Generator().manual_seed(0))

    def run():
        loss = w.loss(w.model, inputs, target)
        loss.backward()
        grads = [p.grad.clone() for p in w.model.parameters() if p.requires_grad]
        w.model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    plain = run()
    w.checkpointing(True)
    assert w.model.is_gradient_checkpointing
    checkpointed = run()
    w.checkpointing(False)
    assert not w.model.is_gradient_checkpointing
    torch.testing.assert_close(checkpointed, plain)


def test_unknown_sizes_are_refused():
    with pytest.raises(ValueError, match="^size 'huge' is not one of"):
        llm.build("huge")


def test_the_base_weights_take_the_dtype_asked_for():
    w = llm.build("tiny", dtype=torch.float32)
    assert {p.dtype for p in w.model.parameters()} == {torch.float32}


def test_the_models_benchmark_builds_it_in_float32_off_a_gpu():
    from benchmarks import workloads

    w = workloads.build("llama-lora", "tiny", "cpu", seed=3)
    again = workloads.build("llama-lora", "tiny", "cpu", seed=3)
    assert w.family == "llm" and {p.dtype for p in w.model.parameters()} == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), again.model.parameters(), strict=True))
