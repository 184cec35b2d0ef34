"""Arms 2 to 5: training steps of the workloads users train, plain against gactx and against checkpointing.

For each method of an arm, on one model and one optimizer (AdamW over the trainable parameters) shared by
the methods, which take turns on it (:meth:`benchmarks.methods.Method.suspend` and ``active``):

1. three warm-up steps: the first one's wall time (compilation and gactx's first adaptation in it) and the
   adaptation's own seconds and passes are kept;
2. the step's peak: ``torch.cuda.max_memory_allocated`` over one step, from a reset of the statistic at its
   start, with everything the process holds counted (weights, optimizer state, data) and the gradients set
   to none before the step, so its peak holds the gradients backward allocates (a CPU: ``gactx.PeakMemory``,
   the profiler's allocations above the step's start);
3. the maximum batch (eager arms): the batch (the first samples, repeated) doubled, then sized by the line
   through the measured peaks (98% of the capacity), then bisected to within 3% where a try fails; it ends
   where the line leaves room for less than 3% more; each try runs two steps, an out-of-memory error is caught
   and the allocator's cache emptied. On a CPU (``--tiny``) nothing runs out of memory, so a
   capacity of four times plain's peak stands in for the GPU's, to run the same search.

Then step time, alternated: rounds in which every method runs one step and then its timed steps, ten timed
steps each in all, each timed by CUDA events around it with no synchronization between steps (a step that
waits for the host shows as the host's time); the median is kept. Compiled methods (arm 5) cannot take turns
on one model (each compiles it afresh) and are timed one after the other.

Then, for plain and L1 (:data:`PROFILED`), where a step's time goes: one step under ``torch.profiler`` (the
device's busy time against the wall's, launches, the ops with the most host and device time) and one under
``cProfile`` (the Python functions with the most time of their own, and gactx's own functions' time), a row
``<arm>/<model>/<method>/profile`` each (:mod:`benchmarks.gpu.profiles`).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import gactx
from benchmarks import workloads
from benchmarks.gpu.harness import Deadline, emit
from benchmarks.gpu.profiles import device_profile, python_profile
from benchmarks.measure import synchronize
from benchmarks.methods import CHECKPOINT_FORMS, Method

__all__ = ["ARMS", "TrainingArm", "is_adaptive", "run", "search_max_batch"]

WARMUP = 3
TIMED = 10  # timed steps a method, in all
ROUNDS = 2  # ... in this many rounds of alternation
TRY_STEPS = 2  # steps a maximum-batch try runs: the second one at the shape's steady state
TOLERANCE = 0.03  # the search stops when the largest fit is within 3% of the smallest failure
HEADROOM = 0.98  # the linear guess aims at 98% of the capacity: the line is not exact
TINY_CAPACITY = 4.0  # --tiny on a CPU: the capacity that stands in for the GPU's, in plain's peaks
PROFILED = ("fp", "L1", *CHECKPOINT_FORMS, "save_on_cpu")  # the methods whose step is profiled, after the timed ones


@dataclass(frozen=True)
class TrainingArm:
    name: str
    models: tuple[str, ...]
    methods: tuple[str, ...]
    batch: int | None  # the batch timed (None: the workload's); maximum batch searches start from it
    tiny_batch: int | None = None
    precision: str = "bf16"
    channels_last: bool = False
    compiled: bool = False
    max_batch: bool = True
    budget_s: float = 0.0  # its time limit on a GPU; set in ARMS
    size: str = "full"  # the workloads' size on a GPU (--tiny: "tiny")

    @property
    def unit(self) -> str:
        return "images" if self.channels_last else "sequences"


ARMS = {
    "llama-lora": TrainingArm(
        "llama-lora", ("llama-lora",), ("fp", "checkpoint", "L1", "checkpoint+L1", "L1.2", "L2.2"), None,
        budget_s=145,
    ),
    "resnet50": TrainingArm(
        "resnet50", ("resnet50",), ("fp", "checkpoint", "L1", "L1.2", "L2.2"), 256, tiny_batch=8, channels_last=True,
        budget_s=85,
    ),
    "bert-large": TrainingArm(
        "bert-large", ("bert-large",), ("fp", "checkpoint", "L1", "L2", "L2.2"), 64, tiny_batch=8, budget_s=75
    ),
    # Checkpointing as users run it, and torch's offloading: Hugging Face's own (the arms' "checkpoint"), every block
    # with what torch offers to make it cheaper, a selective policy, and save_on_cpu (benchmarks/methods.py), with a
    # profile of each step: HF's ran at 0.44x plain on BERT-large where recomputation usually costs 25 to 35% of a step.
    "baselines": TrainingArm(
        "baselines", ("bert-large", "llama-lora"),
        ("fp", "checkpoint", "checkpoint-fast", "checkpoint-selective", "save_on_cpu"), 64, tiny_batch=8,
        max_batch=False, budget_s=90,
    ),
    # BERT-large's 24 layers: its plain compile alone ran past 85 s on an H100 and took 60 s on an H200, where L1's had
    # not finished in 225 s (what AOTAutograd does for each saved tensor's hooks); 6 of them compile in a quarter.
    "compiled": TrainingArm(
        "compiled", ("bert-large",), ("fp", "L1"), 64, tiny_batch=8, compiled=True, max_batch=False, budget_s=110,
        size="6 layers",
    ),
}  # fmt: skip


def _build(name: str, size: str, device: str) -> workloads.Workload:
    if name == "llama-lora":
        from benchmarks import llm

        return llm.build(size, device)
    w = workloads.build(name, size, device)
    # The models benchmark's eager attention saves the probabilities, as in the papers; users get SDPA.
    if w.source.startswith("transformers") and hasattr(w.model, "set_attn_implementation"):
        w.model.set_attn_implementation("sdpa")
        w.source = "transformers (sdpa attention)"
    return w


def _batch(arm: TrainingArm, w: workloads.Workload, tiny: bool) -> int:
    if w.name == "llama-lora":  # its own shape's batch (one 4096-token sequence at full size)
        return w.default_batch
    return (arm.tiny_batch if tiny else arm.batch) or w.default_batch


def _tile(inputs: tuple, target: torch.Tensor, batch: int) -> tuple[tuple, torch.Tensor]:
    """``batch`` samples: the given ones repeated (the data's values do not change a step's memory or time)."""
    n = inputs[0].shape[0]
    index = torch.arange(batch, device=inputs[0].device) % n
    tiled = tuple(t[index] if torch.is_tensor(t) and t.shape[0] == n else t for t in inputs)
    per_sample = target.reshape(n, -1)
    return tiled, per_sample[index].reshape(-1) if target.shape[0] != n else target[index]


class Memory:
    """Peaks and running out of memory on the arm's device (see the module docstring)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.capacity: int | None = torch.cuda.mem_get_info()[1] if device == "cuda" else None

    def step_peak(self, step: Callable[[], None]) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        with gactx.PeakMemory("cpu") as meter:
            step()
        return meter.peak

    def try_steps(self, step: Callable[[], None], steps: int) -> int | None:
        """The peak of the last of ``steps`` steps, or None when they ran out of memory (or past the capacity)."""
        try:
            for _ in range(steps - 1):
                step()
            peak = self.step_peak(step)
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError from torch 2.5 on; this name in all
            peak = None
        finally:
            self.release()
        return peak if peak is not None and (self.capacity is None or peak <= self.capacity) else None

    def release(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def search_max_batch(
    peak_at: Callable[[int], int | None], start: int, start_peak: int, capacity: int, time_ok: Callable[[int], bool]
) -> tuple[int, list[tuple[int, int | None]], bool]:
    """The largest batch whose step fits: ``peak_at(batch)`` is a step's peak or None where it does not fit;
    ``start`` fits with ``start_peak``. Doubles once, then aims at ``capacity`` along the line through the last
    two peaks (at most 8x at a time), and once a batch has failed, aims again after each fit and bisects after
    each failure, until the largest fit is within the tolerance of the smallest failure, or the line through the
    last two fits leaves room for less than the tolerance. A peak on a line takes two tries. Returns the largest
    fit, every (batch, peak) tried, and whether the search ended (False: ``time_ok(batch)`` refused the next try;
    the result is then a lower bound)."""
    lo, lo_peak, hi, slope = start, start_peak, None, 0.0
    tried: list[tuple[int, int | None]] = []
    batch = 2 * start
    while True:
        if not time_ok(batch):
            return lo, tried, False
        peak = peak_at(batch)
        tried.append((batch, peak))
        if peak is None:
            hi = batch
        else:
            slope = (peak - lo_peak) / (batch - lo)
            lo, lo_peak = batch, peak
            # The line through the last two fits leaves room for fewer than the tolerance's samples more: done, with
            # no failing try (a peak that grows faster than the line has a steeper slope there: this one overstates
            # the room, and the search goes on).
            if slope > 0 and (capacity - peak) / slope <= TOLERANCE * batch:
                return lo, tried, True
        step = max(1, int(lo * TOLERANCE))
        if hi is not None and hi - lo <= step:
            return lo, tried, True
        aim = lo + int(HEADROOM * (capacity - lo_peak) / slope) if slope > 0 else 2 * lo
        if hi is None:
            batch = min(max(aim, lo + step), 8 * lo)
        elif peak is not None and lo < aim < hi:
            batch = max(aim, lo + step)
        else:
            batch = (lo + hi) // 2


class Runner:
    """One method of an arm on a shared model and optimizer: its rows and its steps."""

    def __init__(self, arm: TrainingArm, w: workloads.Workload, name: str, optimizer, batch: tuple) -> None:
        self.arm, self.w, self.optimizer = arm, w, optimizer
        self.inputs, self.target = batch
        # On a CPU (--tiny) Inductor's C++ compilation takes a minute a model: AOTAutograd without it (where
        # gactx's hooks are inlined into the graphs) runs the same path in seconds.
        backend = "inductor" if next(w.model.parameters()).is_cuda else "aot_eager"
        self.method = Method(name, w, arm.precision, arm.compiled, compile_backend=backend)
        self.times: list[float] = []
        self.seconds = 1.0  # a step's time, once warmed up
        n = self.inputs[0].shape[0]
        self.row = {"id": f"{arm.name}/{w.name}/{name}", "arm": arm.name, "kind": "training", "model": w.name,
                    "method": name, "compiled": arm.compiled, "batch": n, "unit": "tokens" if w.tokens else arm.unit,
                    "per_sample": w.tokens or 1, "precision": arm.precision, "source": w.source}  # fmt: skip
        if arm.compiled:
            self.row["compile_backend"] = backend
        emit(self.row)  # begun: a method cut off by the arm's limit still shows in the table

    def step_fn(self, inputs: tuple, target: torch.Tensor) -> Callable[[], None]:
        w, method, optimizer = self.w, self.method, self.optimizer

        def step() -> None:
            try:
                with method.forward():
                    loss = w.loss(w.model, inputs, target)
                loss.backward()
                optimizer.step()
            finally:  # also after an out-of-memory error: a partial backward's gradients go with it
                optimizer.zero_grad(set_to_none=True)
            method.after_step(inputs, target)
            self.last_loss = loss.detach()

        return step

    def warm_up(self, memory: Memory) -> None:
        step = self.step_fn(self.inputs, self.target)
        begin = time.perf_counter()
        step()
        synchronize(memory.device)
        self.row["first_step_s"] = time.perf_counter() - begin
        adaptation = self.method.controller.last_adaptation if self.method.controller else None
        if adaptation is not None:
            self.row |= {"adapt_s": adaptation.seconds, "adapt_passes": adaptation.passes,
                         "adapt_partial": adaptation.partial_passes}  # fmt: skip
        for _ in range(WARMUP - 2):
            step()
        last = time.perf_counter()
        step()
        synchronize(memory.device)
        self.seconds = time.perf_counter() - last  # a step's time, for the deadline's estimates
        self.row["warmup_s"] = time.perf_counter() - begin  # compiled: gactx's first pass runs eager, the 2nd compiles
        self.row["peak_bytes"] = memory.step_peak(step)
        self.row["loss"] = float(self.last_loss)
        if not math.isfinite(self.row["loss"]):
            raise FloatingPointError(f"the loss is {self.row['loss']} after {WARMUP} steps")

    def time_steps(self, steps: int, device: str) -> None:
        step = self.step_fn(self.inputs, self.target)
        step()  # the method's first step after another's turn
        if device == "cuda":
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)
            ]
            for begin, end in events:
                begin.record()
                step()
                end.record()
            torch.cuda.synchronize()
            self.times += [begin.elapsed_time(end) / 1e3 for begin, end in events]
        else:
            for _ in range(steps):
                begin = time.perf_counter()
                step()
                self.times.append(time.perf_counter() - begin)
        seconds = statistics.median(self.times)
        self.row |= {"step_ms": seconds * 1e3, "timed_steps": len(self.times),
                     "per_s": self.row["batch"] * self.row["per_sample"] / seconds}  # fmt: skip

    def profile(self, row: dict, device: str) -> None:
        """One step under ``torch.profiler`` and one under ``cProfile``, into ``row`` (module docstring)."""
        step = self.step_fn(self.inputs, self.target)
        step()  # the method's first step after another's turn
        row |= device_profile(step, device)[1]
        row |= python_profile(lambda: (step(), synchronize(device)))[1]

    def max_batch(self, memory: Memory, deadline: Deadline) -> None:
        n, seconds = self.row["batch"], self.seconds

        def peak_at(batch: int) -> int | None:
            return memory.try_steps(self.step_fn(*_tile(self.inputs, self.target, batch)), TRY_STEPS)

        def time_ok(batch: int) -> bool:  # a try's steps grow with the batch; 2x for the allocator and slack
            return deadline.allows(2 * TRY_STEPS * seconds * batch / n + 2)

        best, tried, ended = search_max_batch(peak_at, n, self.row["peak_bytes"], memory.capacity, time_ok)
        self.row |= {"max_batch": best, "max_batch_tries": tried, "max_batch_ended": ended}


def _prepare(arm: TrainingArm, name: str, size: str, device: str, tiny: bool):
    w = _build(name, size, device)
    batch = w.make_batch(_batch(arm, w, tiny), torch.Generator().manual_seed(0))
    if arm.channels_last:
        w.model.to(memory_format=torch.channels_last)
        batch = (tuple(t.contiguous(memory_format=torch.channels_last) for t in batch[0]), batch[1])
    optimizer = torch.optim.AdamW([p for p in w.model.parameters() if p.requires_grad], lr=w.lr)
    return w, batch, optimizer


def _guarded(row: dict, action: Callable[[], None], memory: Memory) -> bool:
    """Run a part of a method's measurement; an error is written into its row (and the part given up)."""
    try:
        action()
        return True
    except Exception as error:  # noqa: BLE001 - any failure of a method is a result to report, not a crash
        row.setdefault("errors", []).append(f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
        memory.release()
        return False
    finally:
        emit(row)


def run(arm: TrainingArm, device: str, tiny: bool, deadline: Deadline) -> None:
    """Each model's methods in phases, so that a short limit still yields the figures that matter most: the fixed
    methods' peaks, then their step times in turns; then the adaptive methods (their first adaptation is the
    longest warm-up), timed in turns with plain again; the maximum batch searches last."""
    size = "tiny" if tiny else arm.size
    memory = Memory(device)
    # On a CPU (the tiny run that keeps this script working between loans) without oneDNN: on a 2-core Xeon with
    # AVX-512, torch 2.13's oneDNN convolution returned a NaN weight gradient from finite inputs (the tiny ResNet's
    # layer4.0.conv2, checkpointed, its third step), and every method after it trained a model of NaNs.
    with torch.backends.mkldnn.flags(enabled=device != "cpu"):
        _run_models(arm, device, size, tiny, memory, deadline)


def _run_models(arm: TrainingArm, device: str, size: str, tiny: bool, memory: Memory, deadline: Deadline) -> None:
    for name in arm.models:
        w, batch, optimizer = _prepare(arm, name, size, device, tiny)
        fixed = [m for m in arm.methods if not is_adaptive(m)]
        runners = _warm_up(arm, name, fixed, w, batch, optimizer, memory, deadline, device)
        _time_in_turns(arm, runners, memory, deadline, device)
        adaptive = [m for m in arm.methods if is_adaptive(m)]
        later = _warm_up(arm, name, adaptive, w, batch, optimizer, memory, deadline, device)
        if later:
            plain = [r for r in runners if r.method.name == "fp"]
            _time_in_turns(arm, plain + later, memory, deadline, device)
        for runner in runners + later:
            with runner.method.active():
                _profile(runner, memory, deadline, device)
        for runner in (runners + later) if arm.max_batch else ():
            if not deadline.allows(5):
                break
            if memory.capacity is None:  # a CPU: plain's peak sets the capacity that stands in for a GPU's
                memory.capacity = int(TINY_CAPACITY * runner.row["peak_bytes"])
            runner.row["capacity_bytes"] = memory.capacity
            with runner.method.active():
                _guarded(runner.row, lambda r=runner: r.max_batch(memory, deadline), memory)
        for runner in runners + later:
            runner.method.close()
        del w, batch, optimizer, runners, later
        memory.release()


def is_adaptive(method: str) -> bool:
    """Whether the method is an adaptive gactx level (with checkpointing or not)."""
    return gactx.config.LEVELS.get(method.removeprefix("checkpoint+"), {}).get("adaptive", False)


def _warm_up(arm, name, methods, w, batch, optimizer, memory, deadline, device) -> list[Runner]:
    """Warm-up and peak of each method, one after another; each is left suspended (compiled: timed and closed)."""
    runners: list[Runner] = []
    for method in methods:
        if not deadline.allows(5):
            emit({"id": f"{arm.name}/{name}/{method}", "kind": "skipped", "arm": arm.name, "reason": "time limit"})
            continue
        runner = Runner(arm, w, method, optimizer, batch)
        ok = _guarded(runner.row, lambda r=runner: r.warm_up(memory), memory)
        if ok and arm.compiled:  # timed now: a compiled method cannot take turns with another
            _guarded(runner.row, lambda r=runner: r.time_steps(TIMED, device), memory)
            _profile(runner, memory, deadline, device)
        if arm.compiled or not ok:
            runner.method.close()
        else:
            runner.method.suspend()
            runners.append(runner)
    return runners


def _profile(runner: Runner, memory: Memory, deadline: Deadline, device: str) -> None:
    """The step profiles of a method of :data:`PROFILED` (module docstring), where the deadline leaves time for them:
    three steps, the profiler's own cost counted as much again."""
    if runner.method.name in PROFILED and not runner.row.get("errors") and deadline.allows(6 * runner.seconds + 2):
        row = {k: runner.row[k] for k in ("arm", "model", "method", "compiled", "batch")}
        row |= {"id": f"{runner.row['id']}/profile", "kind": "step-profile", "step_ms": runner.row.get("step_ms")}
        _guarded(row, lambda: runner.profile(row, device), memory)


def _time_in_turns(arm, runners, memory, deadline, device) -> None:
    """Step times of suspended methods, alternated in ROUNDS turns (a compiled arm's were taken at warm-up)."""
    for _ in range(ROUNDS if not arm.compiled else 0):
        for runner in runners:
            if deadline.allows(2 * (TIMED // ROUNDS + 1) * runner.seconds + 2):
                with runner.method.active():
                    _guarded(runner.row, lambda r=runner: r.time_steps(TIMED // ROUNDS, device), memory)
