"""LLM fine-tuning with gactx: peak memory, gradients and training loss of a Llama-style decoder (``benchmarks/llm.py``)
trained plainly, with gactx, with Hugging Face's gradient checkpointing and with both, full and with LoRA; the width
of the checkpointed layers' inputs; the cross-entropy's saved log-probabilities at a large vocabulary.

Everything runs in float32 on the device (a CPU by default), with random weights and the generated bigram language.

1. **Peaks and gradients** (the ``checkpoint`` shape: 8 layers, hidden 256, vocabulary 2048, sequence 2048, batch 1).
   The peak of one step as ``gactx.PeakMemory`` measures it (the allocator's, or on a CPU the profiler's allocation
   events), gradients set to none before it, and the cosine of the step's gradient with plain PyTorch's (same
   batch, same weights), for plain, gactx L1, L1.1 and L1.2, non-reentrant checkpointing of every layer
   (``gradient_checkpointing_enable``), and checkpointing with each level at ``checkpoint_bits`` 8 and 4.
2. **LoRA peaks** (sequence 512, batch 4, vocabulary 2048, and 8192 as in ``benchmarks/llm.py``'s ``small``; LoRA
   r=16 on every linear layer): plain, each level, checkpointing, checkpointing with L1.
3. **Training**: ``--steps`` AdamW steps on one stream of batches from one base model, for plain, checkpointing
   with L1 (``checkpoint_bits`` 8 and 4), LoRA plain and LoRA with L1 (vocabulary 256), and BERT (the models
   benchmark's small ``bert-base``) plain and checkpointed with L1 at ``checkpoint_bits`` 8 and 4. The LLM's base
   is its random initialisation trained by plain PyTorch for as many steps on a third stream (``PRETRAIN``):
   fine-tuning starts from a model that has left the plateau of the unigram loss. From random weights, when a run
   leaves that plateau decides its loss at step 60, and two streams of plain PyTorch ended 30% apart. The loss is
   the mean of the last tenth of the steps; the curves are plotted (``finetune.png``).
4. **Cross-entropy** at vocabulary 32000 (sequence 512, batch 1): the bytes of the log-probabilities that
   ``log_softmax`` saves (transformers upcasts the logits to float32) against the whole step's saved activations, and
   the cosine, with plain PyTorch's, of the logits' gradient (and the model's) when those log-probabilities are
   stored at 8, 4 and 2 bits (``gactx.quantize``, stochastic rounding) and exponentiated in backward: for the
   model's logits (random weights: a nearly uniform distribution) and for logits that have learned the language
   (each token's four successors share the mass: as peaked as a trained model's).

    python -m benchmarks.finetune                 # writes benchmarks/runs/<device>/finetune.{json,md,csv,png}
    python -m benchmarks.finetune --update-results    # writes the committed benchmarks/results/<device>/finetune.*
    python -m benchmarks.finetune --quick --out /tmp/finetune
    python -m benchmarks.finetune --sections training --update-results   # reruns one section; the others keep
                                                      # their rows from the committed results
"""

from __future__ import annotations

import contextlib
import statistics
import warnings
from pathlib import Path

import torch

import gactx
from benchmarks import llm, workloads
from benchmarks.harness import Bench, kept_rows, read_results, where
from benchmarks.measure import count_saved_bytes
from benchmarks.methods import Method
from benchmarks.table import markdown_table

__all__ = ["run"]

MIB = 1 << 20
SHAPES = {
    "checkpoint": llm.LlamaShape(256, 8, 8, 2, 688, 2048, 2048, 1),
    "lora": llm.LlamaShape(256, 8, 8, 2, 688, 2048, 512, 4),
    "lora-8k": llm.LlamaShape(256, 8, 8, 2, 688, 8192, 512, 4),
    "train": llm.LlamaShape(256, 8, 8, 2, 688, 256, 512, 4),
    "vocab": llm.LlamaShape(256, 2, 8, 2, 688, 32_000, 512, 1),
    "quick": llm.LlamaShape(64, 2, 4, 2, 128, 512, 128, 2),
}
# AdamW rates at which 60 steps move the loss from ln(256) = 5.5 towards the language's 1.39: 2.1 and 3.8 here.
TRAIN_LR = {False: 1e-3, True: 3e-3}  # full, LoRA
PRETRAIN = (1e-3, 0)  # the base model's learning rate and batch stream (the compared runs use streams 1 and 2)
SECTIONS = ("peaks", "lora", "training", "cross-entropy")
LEVELS = ("L1", "L1.1", "L1.2")
CE_BITS = (8, 4, 2)


def _model(shape: str, lora: bool, device: str) -> workloads.Workload:
    llm.LLAMA_SIZES[shape] = SHAPES[shape]  # llm.build takes a size by name
    w = llm.build(shape, device, seed=0, lora=lora)
    w.model.float()  # float32 throughout, from bf16 weights (as a bf16 checkpoint loads in float32)
    return w


@contextlib.contextmanager
def _method(w: workloads.Workload, level: str | None, checkpointed: bool, bits: int | None = 8):
    """The workload with gactx at ``level`` (None: plain) and its own gradient checkpointing on or off."""
    wrapper = Method("checkpoint" if checkpointed else "fp", w)
    controller = None if level is None else gactx.Controller(w.model, level=level, checkpoint_bits=bits).install_hook()
    try:
        yield controller
    finally:
        if controller is not None:
            controller.uninstall_hook()
        wrapper.close()


def _gradient(w: workloads.Workload, batch) -> torch.Tensor:
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # LoRA's dropout draws the same masks for every method
    w.loss(w.model, *batch).backward()
    return torch.cat([p.grad.flatten() for p in w.model.parameters() if p.grad is not None])


def _peak(w: workloads.Workload, batch) -> int:
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with gactx.PeakMemory(next(w.model.parameters()).device) as meter:
        w.loss(w.model, *batch).backward()
    return meter.peak


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def _methods(lora: bool) -> list[tuple[str, str | None, bool, int | None]]:
    """(label, level, checkpointed, checkpoint_bits) of the peaks sections."""
    rows = [("plain", None, False, None), *((lvl, lvl, False, 8) for lvl in LEVELS), ("checkpoint", None, True, None)]
    for level in ("L1",) if lora else LEVELS:
        rows += [(f"checkpoint + {level}", level, True, 8)]
        if not lora:
            rows += [(f"checkpoint + {level}, inputs at 4 bits", level, True, 4)]
    return rows


def peaks(shape: str, lora: bool, device: str) -> list[dict]:
    """Section 1 (``lora=False``) or 2: peak and gradient cosine of each method."""
    w = _model(shape, lora, device)
    s = llm.LLAMA_SIZES[shape]
    batch = w.make_batch(s.batch, torch.Generator().manual_seed(0))
    reference = _gradient(w, batch)
    rows = []
    for label, level, checkpointed, bits in _methods(lora):
        with _method(w, level, checkpointed, bits) as controller:
            _gradient(w, batch)  # warm-up: the op watcher's pass, the kernels' build
            cosine = _cosine(_gradient(w, batch), reference)
            peak = _peak(w, batch)
            recomputed = None if controller is None else controller.memory_stats(backward=True)
        rows.append({"section": "peaks", "lora": lora, "shape": shape, "method": label,
                     "peak_mib": peak / MIB, "cosine": cosine,
                     "recomputed_held_mib": None if not recomputed or not recomputed.tensors else
                     recomputed.packed_bytes / MIB})  # fmt: skip
    plain = rows[0]["peak_mib"]
    checkpoint = next(r["peak_mib"] for r in rows if r["method"] == "checkpoint")
    for r in rows:
        r["vs_plain"] = r["peak_mib"] / plain
        r["vs_checkpoint"] = r["peak_mib"] / checkpoint
    return rows


def _train(w: workloads.Workload, steps: int, batch_size: int, level: str | None, checkpointed: bool, bits: int,
           lr: float, stream: int = 1):  # fmt: skip
    """Losses of ``steps`` AdamW steps from the workload's initial weights (restored after), on the batches drawn
    from ``stream``."""
    initial = {k: v.clone() for k, v in w.model.state_dict().items()}
    params = [p for p in w.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    gen = torch.Generator().manual_seed(stream)
    torch.manual_seed(4)  # dropout's masks: one stream for every method
    losses = []
    with _method(w, level, checkpointed, bits) as controller:
        for _ in range(steps):
            inputs, target = w.make_batch(batch_size, gen)
            optimizer.zero_grad(set_to_none=True)
            loss = w.loss(w.model, inputs, target)
            loss.backward()
            optimizer.step()
            if controller is not None:
                controller.iterate()
            losses.append(loss.item())
    w.model.load_state_dict(initial)
    return losses


def _pretrain(w: workloads.Workload, steps: int, batch_size: int) -> float:
    """Train the workload's base weights (not LoRA's) in place with plain PyTorch: the model fine-tuning starts from.
    Returns the last step's loss."""
    lr, stream = PRETRAIN
    flags = {p: p.requires_grad for p in w.model.parameters()}
    base = [p for name, p in w.model.named_parameters() if "lora_" not in name]
    for p in flags:
        p.requires_grad_(False)
    for p in base:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(base, lr=lr)
    gen = torch.Generator().manual_seed(stream)
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = w.loss(w.model, *w.make_batch(batch_size, gen))
            loss.backward()
            optimizer.step()
    finally:
        w.model.zero_grad(set_to_none=True)
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return loss.item()


def training(steps: int, device: str, quick: bool) -> list[dict]:
    """Section 3: the final losses and curves."""
    # "another batch stream": plain PyTorch on other batches of the same language, the spread of plain's own loss
    runs = [("llama", False, "plain", None, False, 8), ("llama", False, "plain, another batch stream", None, False, 8),
            ("llama", False, "checkpoint + L1", "L1", True, 8),
            ("llama", False, "checkpoint + L1, inputs at 4 bits", "L1", True, 4),
            ("llama-lora", True, "plain", None, False, 8),
            ("llama-lora", True, "plain, another batch stream", None, False, 8),
            ("llama-lora", True, "L1", "L1", False, 8),
            ("bert-base", None, "plain", None, False, 8), ("bert-base", None, "checkpoint + L1", "L1", True, 8),
            ("bert-base", None, "checkpoint + L1, inputs at 4 bits", "L1", True, 4)]  # fmt: skip
    shape = "quick" if quick else "train"
    rows, built, base_loss = [], {}, {}
    for model, lora, label, level, checkpointed, bits in runs:
        if model not in built:
            if model == "bert-base":
                built[model] = workloads.build("bert-base", "tiny" if quick else "small", device, seed=0)
            else:
                built[model] = _model(shape, lora, device)
                base_loss[model] = _pretrain(built[model], steps, llm.LLAMA_SIZES[shape].batch)
        w = built[model]
        batch = llm.LLAMA_SIZES[shape].batch if model != "bert-base" else w.default_batch
        lr = w.lr if model == "bert-base" else TRAIN_LR[lora]
        losses = _train(w, steps, batch, level, checkpointed, bits, lr, 2 if "another" in label else 1)
        rows.append({"section": "training", "model": model, "method": label, "steps": steps, "lr": lr, "losses": losses,
                     "base_loss": base_loss.get(model),
                     "final_loss": statistics.mean(losses[-max(1, steps // 10):])})  # fmt: skip
    for r in rows:
        plain = next(p for p in rows if p["model"] == r["model"] and p["method"] == "plain")
        r["vs_plain"] = r["final_loss"] / plain["final_loss"]
    return rows


class _StoredLogSoftmax(torch.autograd.Function):
    """``log_softmax`` whose saved result is stored by ``gactx.quantize`` at ``bits`` and decoded in backward, as a
    rule storing it would: ``grad - exp(log_p) * sum(grad)``."""

    @staticmethod
    def forward(ctx, x, bits, seed):
        out = torch.log_softmax(x, dim=-1)
        ctx.stored = gactx.quantize(out, bits, stochastic=True, seed=seed)
        return out

    @staticmethod
    def backward(ctx, grad):
        log_p = gactx.dequantize(ctx.stored)
        return grad - log_p.exp() * grad.sum(-1, keepdim=True), None, None


def _learned_logits(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits of a model that has learned the generated language: each token's four successors share the mass
    (logit 16 against about 0 elsewhere, with a little noise), as peaked as a trained model's distribution is. A
    random model's distribution is nearly uniform, so its log-probabilities span a narrow range that any width
    stores well: the peaked one is the case to measure."""
    successors = llm.successors(vocab)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(ids.shape[1] - 1, vocab, generator=gen)
    logits.scatter_add_(1, successors[ids[0, :-1]], torch.full((ids.shape[1] - 1, llm.SUCCESSORS), 16.0))
    return logits


def cross_entropy(device: str, quick: bool) -> list[dict]:
    """Section 4: for the model's logits (random weights) and for logits that have learned the language."""
    shape = "quick" if quick else "vocab"
    w = _model(shape, False, device)
    s = llm.LLAMA_SIZES[shape]
    ids = w.make_batch(1, torch.Generator().manual_seed(0))[0][0]
    labels = ids[:, 1:].flatten()
    learned = _learned_logits(ids, s.vocab)

    def step(bits: int | None, logits_of: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        w.model.zero_grad(set_to_none=True)
        if logits_of == "model":
            logits = w.model(input_ids=ids).logits[:, :-1].flatten(0, 1).float()
            logits.retain_grad()
        else:
            logits = learned.clone().requires_grad_()
        log_p = torch.log_softmax(logits, -1) if bits is None else _StoredLogSoftmax.apply(logits, bits, 7)
        torch.nn.functional.nll_loss(log_p, labels).backward()
        if logits_of != "model":
            return logits.grad, None
        return logits.grad, torch.cat([p.grad.flatten() for p in w.model.parameters() if p.grad is not None])

    saved, _ = count_saved_bytes(w.model, lambda: w.loss(w.model, (ids,), labels))
    learned_log_p = torch.log_softmax(learned, -1).gather(1, labels[:, None]).mean().item()
    numel = labels.numel() * s.vocab
    rows = []
    for logits_of in ("model", "learned"):
        plain_logits, plain_model = step(None, logits_of)  # gradients of the logits and of the model, plainly
        for bits in (None, *CE_BITS):
            logits_grad, model_grad = (plain_logits, plain_model) if bits is None else step(bits, logits_of)
            stored = gactx.expected_nbytes(numel, torch.float32, 32 if bits is None else bits)
            rows.append({"section": "cross-entropy", "logits": logits_of, "vocab": s.vocab, "tokens": labels.numel(),
                         "bits": "kept" if bits is None else bits, "stored_mib": stored / MIB,
                         "step_saved_mib": saved / MIB,
                         "target_log_p": learned_log_p if logits_of == "learned" else None,
                         "logits_cosine": _cosine(logits_grad.flatten(), plain_logits.flatten()),
                         "model_cosine": None if model_grad is None else _cosine(model_grad, plain_model)})  # fmt: skip
    return rows


def _section(row: dict) -> str:
    return ("lora" if row["lora"] else "peaks") if row["section"] == "peaks" else row["section"]


def _kept_rows(folder: Path, sections: set[str], env: dict) -> list[dict]:
    """The rows of the sections not rerun, from ``folder``'s finetune.json, in section order; ``env["kept"]`` says
    which sections came from which earlier run."""
    old = None if sections >= set(SECTIONS) else read_results(folder, "finetune")
    if old is None:
        return []
    kept, env["kept"] = kept_rows(old, "rows", "kept", _section, sections)
    return kept


def render(rows: list[dict], env: dict) -> str:
    lines = [f"# LLM fine-tuning on {env['device_name']}", "",
             f"- torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}; run {env['date']}; "
             f"{env['threads']} torch thread(s); float32; peaks from `gactx.PeakMemory` ({env['peak_method']}), "
             "gradients set to none"]  # fmt: skip
    for name, date in env.get("kept", {}).items():
        lines += [f"- section {name}: from the run of {date}"]
    lines += [""]
    for shape, lora in dict.fromkeys((r["shape"], r["lora"]) for r in rows if r["section"] == "peaks"):
        part = [r for r in rows if r["section"] == "peaks" and r["shape"] == shape and r["lora"] == lora]
        s = SHAPES[shape]
        lines += [f"## {'LoRA peaks' if lora else 'Peaks and gradients'}, vocabulary {s.vocab}", "",
                  f"Llama-style, {s.layers} layers, hidden {s.hidden}, vocabulary {s.vocab}, sequence {s.sequence}, "
                  f"batch {s.batch}" + (", LoRA r=16 on every linear layer" if lora else ""), ""]  # fmt: skip
        cells = [[r["method"], f"{r['peak_mib']:.1f}", f"{r['vs_plain']:.2f}x", f"{r['vs_checkpoint']:.3f}x",
                  f"{r['cosine']:.5f}", "" if r["recomputed_held_mib"] is None else f"{r['recomputed_held_mib']:.1f}"]
                 for r in part]  # fmt: skip
        lines += markdown_table(["method", "peak MiB", "vs plain", "vs checkpointing", "gradient cosine",
                                 "recomputed, held MiB (gactx's count)"], cells) + [""]  # fmt: skip
    part = [r for r in rows if r["section"] == "training"]
    if part:
        t = SHAPES["train"]
        lines += ["## Training", "", f"{part[0]['steps']} AdamW steps on one stream of batches from one base model; "
                  "loss: the mean of the last tenth of the steps. The Llama-style model: "
                  f"{t.layers} layers, hidden {t.hidden}, vocabulary {t.vocab}, sequence {t.sequence}, batch {t.batch} "
                  f"(learning rate {TRAIN_LR[False]:g}, LoRA {TRAIN_LR[True]:g}); its base: random weights trained "
                  f"{part[0]['steps']} steps by plain PyTorch on another stream (learning rate {PRETRAIN[0]:g}; "
                  "LoRA's: its base weights, before the adapters train). BERT: the models benchmark's small bert-base, "
                  "from random weights", ""]  # fmt: skip
        cells = [[r["model"], r["method"], f"{r['final_loss']:.4f}", f"{100 * (r['vs_plain'] - 1):+.2f}%"]
                 for r in part]  # fmt: skip
        lines += markdown_table(["model", "method", "final loss", "against plain"], cells) + [""]
    part = [r for r in rows if r["section"] == "cross-entropy"]
    if part:
        r0 = part[0]
        lines += ["## Cross-entropy", "", f"vocabulary {r0['vocab']}, {r0['tokens']} tokens: the log-probabilities "
                  f"that `log_softmax` saves against the step's {r0['step_saved_mib']:.1f} MiB of saved activations "
                  "(plain PyTorch's, counted by a hook)", ""]  # fmt: skip
        cells = [[{"model": "the model's (random weights)", "learned": "learned (synthetic)"}[r["logits"]], r["bits"],
                  f"{r['stored_mib']:.1f}", f"{r['logits_cosine']:.6f}",
                  "" if r["model_cosine"] is None else f"{r['model_cosine']:.6f}"] for r in part]  # fmt: skip
        lines += markdown_table(["logits", "log-probabilities", "stored MiB", "logits' gradient cosine",
                                 "model's gradient cosine"], cells, left=2) + [""]  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    part = [r for r in rows if r["section"] == "training"]
    models = list(dict.fromkeys(r["model"] for r in part))
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for r in (r for r in part if r["model"] == model):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["method"], linewidth=1)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("finetune", __doc__, quick="tiny shapes, 4 steps")
    p = bench.parser
    p.add_argument(
        "--sections",
        nargs="+",
        default=list(SECTIONS),
        choices=SECTIONS,
        help="sections to run; the others keep their rows from the results file already in the folder written",
    )
    p.add_argument("--steps", type=int, default=60, help="training steps a run")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = bench.parse(argv)
    if args.quick:
        args.steps = 4
        for name in ("checkpoint", "lora", "train", "vocab"):
            SHAPES[name] = SHAPES["quick"]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed checkpointing methods
    import peft
    import transformers

    env = bench.environment(args.device, transformers=transformers.__version__, peft=peft.__version__,
                            steps=args.steps, peak_method=gactx.PeakMemory(args.device).method)  # fmt: skip
    rows = []
    if "peaks" in args.sections:
        rows += peaks("checkpoint", False, args.device)
    if "lora" in args.sections:
        rows += peaks("lora", True, args.device) + ([] if args.quick else peaks("lora-8k", True, args.device))
    if "training" in args.sections:
        rows += training(args.steps, args.device, args.quick)
    if "cross-entropy" in args.sections:
        rows += cross_entropy(args.device, args.quick)
    folder = bench.folder(args, args.device)
    rows = _kept_rows(folder, set(args.sections), env) + rows
    table = render(rows, env)
    folder.mkdir(parents=True, exist_ok=True)  # the plot comes first: the table links it
    if plot(rows, folder / "finetune.png"):
        table += "\n![training curves](finetune.png)\n"
    bench.write(folder, env, rows, table)
    print(table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    run()
