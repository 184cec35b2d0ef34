"""The GPU evaluation: one command that measures gactx where users train, sized to a short loan of one GPU.

    python -m benchmarks.gpu                  # on a GPU: under 9 minutes on one H100
    python -m benchmarks.gpu --update-results # the same, into the committed benchmarks/results/<gpu>/
    python -m benchmarks.gpu --tiny           # the same code at tiny sizes, on any machine, in a minute
    python -m benchmarks.gpu --arms kernels llama-lora --limit llama-lora=200

Arms, in the order they run (the first ones matter most when time is short), each in a process of its own
under its own time limit (``--limit ARM=SECONDS``; all of them within ``--budget-s``):

0. ``tests``: the kernel tests and the pack path's (``tests/kernels``, ``test_pack.py``, ``test_lane.py``; not the
   ahead-of-time compiles) on the device, with the Triton its torch pins: counts and failures
   (:mod:`benchmarks.gpu.suite`; ``--tiny``: one short file).
1. ``kernels``: quantize and dequantize against ``torch.clone`` on 1 to 256 MiB, float32 and bfloat16, at 2,
   4 and 8 bits: GB/s, host microseconds a call, kernel launches a call (:mod:`benchmarks.gpu.kernels`).
2. ``host``: ``benchmarks.host``'s MLP of 64 x 64 tensors, eager and compiled: host time a saved tensor.
3. ``llama-lora``: a Llama-3.2-1B-shaped model (``benchmarks/llm.py``), LoRA r=16, bf16, SDPA, sequence 4096:
   plain, Hugging Face gradient checkpointing, gactx L1, checkpointing + L1, L1.2 and L2.2.
4. ``resnet50``: torchvision's ResNet-50, bf16 autocast, channels_last, batch 256: plain, checkpointing, L1,
   L1.2, L2.2.
5. ``bert-large``: transformers' BERT-large, sequence 128, batch 64: plain, checkpointing, L1, L2, L2.2.
6. ``compiled``: BERT-large's shape with 6 of its 24 layers under ``torch.compile``, plain and L1.
7. ``adaptation``: where an adaptation's time goes, ResNet-50 at L2.2 as in arm 4: a later adaptation timed, one
   under ``torch.profiler`` (the device's busy time against the wall's, launches a pass, the top ops) and one under
   ``cProfile`` (:mod:`benchmarks.gpu.adaptation`).

Within a training arm, each model's methods run in phases, so that a short limit still yields what matters
most: the fixed methods' warm-ups and peaks, their step times in turns, then the adaptive methods (their first
adaptation is the longest warm-up) timed in turns with plain again, then where plain's and L1's step time goes
(one step under ``torch.profiler``, one under ``cProfile``: :mod:`benchmarks.gpu.profiles`), and the maximum batch
searches last.

For each training method: the step's peak (``max_memory_allocated``), throughput (median of 10 steps after 3
warm-up steps, alternated between methods) and the maximum batch (:mod:`benchmarks.gpu.training`), each
beside its ratio to plain in the same run. Results are written as each row arrives to
``benchmarks/runs/<device>/gpu.{json,md,csv,png}`` (git-ignored; ``--tiny``: its ``quick/``), with ``--update-results``
to the committed ``benchmarks/results/<device>/``, or to ``--out DIR``, with the goals they are read against
(reported, not asserted). Nothing is downloaded: models are built from configs
with random weights, inputs are generated.
"""

__all__: list[str] = []
