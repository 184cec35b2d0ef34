"""A decoder LLM fine-tuned with LoRA, the way most people who run out of activation memory train today.

``build(size, device)`` gives a Llama-style model from ``transformers``' ``LlamaConfig`` (RMSNorm, SwiGLU,
rotary positions, grouped-query attention through SDPA) with random weights, wrapped by ``peft`` with LoRA
adapters of rank 16 on every linear layer but the output head, as a :class:`benchmarks.workloads.Workload`:

- ``full`` is Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 key-value heads, intermediate 8192,
  vocabulary 128256, tied embeddings) at sequence 4096: for a GPU;
- ``small`` (4 layers, hidden 256, vocabulary 256, sequence 256, batch 4) trains in a fraction of a second a step
  on a 2-core CPU, and learns the language in a few dozen steps; ``tiny`` is the smallest that runs every code path.

The base weights are stored in bfloat16 (as LoRA fine-tuning loads them), the adapters in float32 (peft's
default), and the step runs under bf16 autocast. The loss is the model's own (``labels=``: transformers
shifts the labels and upcasts the logits to float32, as it does for its users).

The data is a generated bigram language: every token has four possible successors, drawn once from a fixed
seed, so a model can learn it (its entropy is ln 4 = 1.39 nats a token) and nothing is downloaded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.workloads import TASK_SEED, Batch, Workload

__all__ = ["LLAMA_SIZES", "LORA_RANK", "LlamaShape", "build"]

LORA_RANK = 16
LORA_ALPHA = 32  # alpha = 2r: peft's examples and most published LoRA recipes
LORA_DROPOUT = 0.05  # peft's examples' value: it adds a mask and a dropped copy of each adapter's input
SUCCESSORS = 4  # each token's possible next tokens in the generated language
# A usual LoRA learning rate for AdamW at full size; the CPU sizes take a rate at which their few dozen steps
# learn the language (3e-3: loss 5.6 to 3.8 in 60 steps at vocabulary 256, benchmarks/finetune.py).
LLM_LR = {"full": 2e-4, "small": 3e-3, "tiny": 3e-3, "scratch": 3e-3, "scratch-tiny": 5e-3}
# The sensitivity probe of the adaptive levels runs on one sequence cut to this many tokens: its bits are
# kept by slot (module, call, index), not by shape, so they apply to the full sequences; a full 4096-token
# sequence would make each of the estimator's hundreds of passes cost a training step.
PROBE_TOKENS = 512


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    sequence: int
    batch: int  # default_batch: sequences a step


LLAMA_SIZES = {
    "full": LlamaShape(2048, 16, 32, 8, 8192, 128_256, 4096, 1),  # Llama-3.2-1B
    "small": LlamaShape(256, 4, 8, 2, 688, 256, 256, 4),
    "tiny": LlamaShape(32, 2, 4, 2, 64, 256, 32, 4),
    # Trained from scratch by benchmarks/quality.py (every weight, float32): "scratch" learns the language in about
    # 150 steps, past the phase where attention sharpens; "scratch-tiny", about ten times cheaper a step, in 200.
    "scratch": LlamaShape(256, 4, 8, 2, 688, 128, 128, 4),
    "scratch-tiny": LlamaShape(128, 2, 4, 2, 344, 64, 64, 4),
}


def _config(s: LlamaShape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=max(s.sequence, 2048),
        rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip


def successors(vocab: int) -> torch.Tensor:
    """The generated language: each token's ``SUCCESSORS`` possible next tokens, ``(vocab, SUCCESSORS)``."""
    return torch.randint(0, vocab, (vocab, SUCCESSORS), generator=torch.Generator().manual_seed(TASK_SEED))


def _token_batches(vocab: int, length: int, device: torch.device):
    following = successors(vocab)

    def make_batch(b: int, gen: torch.Generator) -> Batch:
        picks = torch.randint(0, SUCCESSORS, (b, length), generator=gen)
        ids = torch.empty(b, length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (b,), generator=gen)
        for i in range(1, length):
            ids[:, i] = following[ids[:, i - 1], picks[:, i]]
        ids = ids.to(device)
        return (ids,), ids[:, 1:].flatten()  # the target: every next token, for accuracy

    return make_batch


def _loss(model: nn.Module, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inputs[0], labels=inputs[0]).loss


def _logits(model: nn.Module, inputs: tuple) -> torch.Tensor:
    return model(input_ids=inputs[0]).logits[:, :-1].flatten(0, 1)


def _probe_batch(inputs: tuple, target: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    ids = inputs[0][:1, :PROBE_TOKENS]
    return (ids,), ids[:, 1:].flatten()


def build(
    size: str = "full", device: str | torch.device = "cpu", seed: int = 0, lora: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> Workload:  # fmt: skip
    """The LoRA-wrapped Llama-style model at ``size`` on ``device``, in train mode, its weights drawn on
    ``device`` from ``seed`` (on a GPU: 1.2 billion parameters drawn on the CPU would take a minute). The
    caller's RNG state is left as it was. ``lora=False``: the base model, every weight trained. ``dtype``: the
    base weights' (the adapters are float32)."""
    from transformers import LlamaForCausalLM

    if size not in LLAMA_SIZES:
        raise ValueError(f"size {size!r} is not one of {tuple(LLAMA_SIZES)}")
    s, device = LLAMA_SIZES[size], torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(_config(s)).to(dtype)
        if lora:
            from peft import LoraConfig, get_peft_model

            adapters = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                                  target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
            model = get_peft_model(model, adapters)
    model.train()
    layers = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == s.layers]

    def checkpointing(on: bool) -> None:
        # transformers 5.24 renames these activation_checkpointing_* and warns; 5.17 has only these names.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if on:  # non-reentrant, transformers 5's default, said so that every version does it
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()

    return Workload(
        name="llama-lora" if lora else "llama", family="llm", model=model,
        make_batch=_token_batches(s.vocab, s.sequence, device), loss=_loss, blocks=list(layers[0]),
        default_batch=s.batch, metric="accuracy", logits=_logits,
        source="transformers LlamaConfig (sdpa attention)" + (f" + peft LoRA r={LORA_RANK}" if lora else ""),
        lr=LLM_LR.get(size, LLM_LR["full"]), checkpointing=checkpointing, sub_batch=_probe_batch, tokens=s.sequence,
    )  # fmt: skip
