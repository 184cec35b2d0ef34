"""Host cost of gactx a saved tensor: where a step is short, what a step pays is Python, not kernels.

The model is 8 x (``Linear(w, w)`` + GELU) on a batch of ``w`` rows, whose step saves 16 tensors of ``w x w``
that gactx compresses (the linear layers' inputs as codes, the GELUs' as FewBit codes). A gactx step ends with
``controller.iterate()``, as a training loop's does (compiled graphs' saves are read there). Plain PyTorch and
each method are timed in turns, round after round, in one process (one torch thread by default), and their
median steps compared. Methods: gactx L0 (hooks installed, nothing compressed), L1 and L1.1, eagerly, and
plain, L0 and L1 under ``torch.compile`` (of the whole model; against compiled plain), and plain and L1 compiled with
Inductor's C++ wrapper (``options={"cpp_wrapper": True}``: the graph's own code calls the kernels from C++, not from
Python; against plain compiled so; full runs only, its compile takes about 30 s a graph), and L1 compiled with
``backend="torch"`` (the format in torch ops that Inductor compiles into the graph's own kernels, no op of gactx's
but a tick a save; against compiled plain; full runs only).

At ``w = 64`` kernel time vanishes and the difference to plain is host time: it is split, a save, into

- hooks and bookkeeping: L0 against plain (the hooks, the module tracker, the policy, the record);
- compression: L1 against L0 (choosing the storage, the kernel calls, the handle);
- pack and unpack: each hook's own wall time under L1, measured by a saved-tensor hook around gactx's;
- the hooks' host time a save: both hooks' time in a step less the time inside the C++ kernels' calls (CPU), shared
  over the step's compressed saves: what gactx's host code (Python, and the C++ lane's own checks and record) costs a
  save, kernels excluded (the floor's is the least a hook pays).

On a CPU the method ``L1-native`` packs L1's saves by launches from C++ (``gactx.kernels.native``) into a recording
driver (``benchmarks/driver``) in place of the CUDA driver: it records each launch and runs no kernel, so what it
measures is the native path's host cost, launches counted as host work; on a GPU it is L1, and ``L1-launcher`` sends
L1's saves through Triton's launcher instead.

For each method: the Python calls into gactx a save makes (0 is the goal inside compiled graphs) and, on a
GPU, the kernel launches a save adds (``torch.profiler``'s GPU activities of a step, less plain's).

The method ``floor`` is not gactx: it is the least a library of eager saved-tensor hooks pays that names each save by
the module that made it. A forward pre- and post-hook on each module that pushes and pops a frame (what names a save),
and a pack hook that keeps parameters and sends every other tensor through the same kernel call gactx's pack path ends
in (2-bit codes), with its decode on unpack: no policy, no key, no record, no handle. gactx pays those hooks only
until two passes in a row saved the same; then its keys go by position, with the model's own hook alone
(``gactx/controller/identity.py``), the saves of such passes are taken by the C++ lane (``gactx/controller/lane.py``:
no Python frame of gactx's for a save), and it may read below the floor. L0 replays no save, so the lane hands each
of its saves to the Python path: L0 against plain is the Python path's hooks and bookkeeping, and L1 against L0
("compression") may read below zero.

    python -m benchmarks.host                  # writes benchmarks/runs/<device>/host.{json,md,csv} (git-ignored)
    python -m benchmarks.host --update-results # writes the committed benchmarks/results/<device>/host.*
    python -m benchmarks.host --quick --out /tmp/host
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import gactx
from benchmarks.driver import build as build_driver
from benchmarks.driver import buildable as driver_buildable
from benchmarks.harness import Bench, alternate, where
from benchmarks.measure import gpu_activities, synchronize
from benchmarks.table import markdown_table
from gactx.controller.identity import passes_saves_on
from gactx.kernels import cpu, dequantize, native
from gactx.kernels.functional import choose_backend, quantize_checked

__all__ = ["METHODS", "base_of", "measure", "methods", "run"]

BLOCKS = 8  # Linear + GELU blocks: 16 compressed saves a step
# Each against its plain (a compiled one against compiled plain).
METHODS = (
    "floor", "L0", "L1", "L1-native", "L1-launcher", "L1.1", "L0+compile", "L1+compile", "L1+compile-torch",
    "L1+compile-cpp",
)  # fmt: skip
NATIVE = "-native"  # on a CPU: L1's saves packed by native launches through the recording driver (benchmarks/driver)
LAUNCHER = "-launcher"  # on a GPU: L1's saves through Triton's launcher (gactx.kernels.native.ENABLED false)
CPP_WRAPPER = "-cpp"  # a method's suffix: compiled with Inductor's C++ wrapper
TORCH_BACKEND = "-torch"  # a method's suffix: gactx's backend="torch", the format traced into the graph
GACTX = str(Path(gactx.__file__).resolve().parent)


def mlp(width: int, device: str) -> torch.nn.Module:
    layers = [m for _ in range(BLOCKS) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*layers).to(device)


class Case:
    """One way to run the MLP's step: its own copy of the model, and gactx's controller where it has one."""

    def __init__(self, name: str, width: int, device: str) -> None:
        torch.manual_seed(0)
        self.name, self.model = name, mlp(width, device)
        self.x = torch.randn(width, width, device=device)
        level, _, compiled = name.removesuffix(NATIVE).removesuffix(LAUNCHER).partition("+")
        self.native = name.endswith(NATIVE)
        self.launcher = name.endswith(LAUNCHER)
        backend = "torch" if compiled.endswith(TORCH_BACKEND) else "auto"
        plain = level in ("plain", "floor")
        self.controller = None if plain else gactx.Controller(self.model, level=level, backend=backend)
        self.compiled = bool(compiled)
        options = {"cpp_wrapper": True} if compiled.endswith(CPP_WRAPPER) else None
        self.forward = torch.compile(self.model, options=options) if compiled else self.model
        self.device = device

    def step(self) -> None:
        self.forward(self.x).sum().backward()
        self.model.zero_grad(set_to_none=True)
        if self.controller is not None:
            self.controller.iterate()  # as a training loop calls it: compiled graphs' saves are read there

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """The case's gactx hooks installed for the block (none for plain). A compiled case then runs a step first,
        untimed: the first pass after an installation begins gactx's pass bookkeeping (graphs are not compiled again:
        a controller installed again has the module hooks it had). The native method's saves go through the
        recording driver, the launcher method's through Triton's launcher (what its packers were made under)."""
        if self.native and self.device == "cpu":
            with native.recording(str(recording_driver())), self._hooks():
                yield
            return
        if self.launcher:
            enabled, native.ENABLED = native.ENABLED, False
            try:
                with self._hooks():
                    yield
            finally:
                native.ENABLED = enabled
            return
        with self._hooks():
            yield

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        if self.name == "floor":
            with floor_hooks(self.model):
                yield
            return
        if self.controller is None:
            yield
            return
        with self.controller:
            if self.compiled:
                self.step()
            yield

    def turn(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` steps, with the case's hooks installed."""
        times = []
        with self.hooks():
            for _ in range(steps):
                synchronize(self.device)
                begin = time.perf_counter()
                self.step()
                synchronize(self.device)
                times.append(time.perf_counter() - begin)
        return times

    def saves(self) -> int:
        """Compressed saves a step (gactx's records of the last pass)."""
        if self.controller is None:
            return 0
        return sum(1 for r in self.controller.records if r.compressed)


@functools.lru_cache(maxsize=1)
def recording_driver() -> Path:
    """The recording driver's library, built once into a temporary folder (benchmarks/driver)."""
    built = build_driver(Path(tempfile.mkdtemp(prefix="gactx-recording-")))
    if built is None:
        raise RuntimeError("the native method needs a C compiler and the triton wheel's cuda.h (benchmarks/driver)")
    return built


@contextlib.contextmanager
def floor_hooks(model: torch.nn.Module, bits: int = 2, group_size: int = 256) -> Iterator[None]:
    """The method ``floor`` (see the module docstring) installed on ``model``."""
    frames: list[list] = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def enter(name: str, module, args) -> None:
        frames.append([name, 0])

    def leave(name: str, module, args, output) -> None:
        frames.pop()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() in params:
            return t
        if frames:
            frames[-1][1] += 1
        return quantize_checked(t, bits, group_size, True, 1 + len(frames), choose_backend(t, "auto"))

    def unpack(stored):
        return stored if isinstance(stored, torch.Tensor) else dequantize(stored)

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(functools.partial(enter, name)))
        handles.append(module.register_forward_hook(functools.partial(leave, name), always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for handle in handles:
            handle.remove()


def python_calls(case: Case) -> int:
    """Calls of Python functions of the gactx package during one step (the hooks' and what they call), in this
    thread, as a training loop's steps make them (two steps first: an installation's first passes follow every module
    call, until keys go by position): on a GPU, backward's own threads (where unpack runs) are not counted."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(GACTX):
            calls += 1

    with case.hooks():
        case.step()
        case.step()
        sys.setprofile(count)
        try:
            case.step()
        finally:
            sys.setprofile(None)
    return calls


def launches(case: Case) -> int | None:
    """GPU activities of one step (kernels, memsets, copies); None off a GPU."""
    with case.hooks():
        return gpu_activities(case.step, case.device)


def hook_us(case: Case, steps: int) -> dict[str, float]:
    """Wall microseconds of the case's hooks (gactx's, or the floor's), eager only: its pack and unpack hook called
    from a saved-tensor hook pair of ours. ``pack_us`` and ``unpack_us``: a call's mean; ``host_us``: a compressed
    save's share of both hooks' time less the time spent inside the C++ kernels' calls (on a CPU: each function of
    the built extension timed around its call, and the packers the C++ lane calls by the extension itself; the timers'
    own cost counts as host time). Off a CPU ``host_us`` is
    left out: kernels there return before they run."""
    spent = {"pack": [0.0, 0], "unpack": [0.0, 0], "kernels": [0.0, 0]}

    def timed(name: str, fn: Callable) -> Callable:
        @passes_saves_on  # a frame between autograd and gactx's path: no call site (keys by position check those)
        def hook(*args):
            begin = time.perf_counter()
            out = fn(*args)
            spent[name][0] += time.perf_counter() - begin
            spent[name][1] += 1
            return out

        return hook

    # The C++ lane's packers (lane.py), called from C++ where no wrapper of ours sees them, are timed by the extension.
    # The native method's packers launch kernels: all of their work is host work, none is subtracted.
    on_cpu = case.device == "cpu" and not case.native
    lane_timing = getattr(cpu.built, "lane_timing", None) if on_cpu else None
    with case.hooks(), _kernels_timed(timed if on_cpu else None):
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with _hooks_timed(pack, unpack, timed):
            if lane_timing is not None:
                lane_timing(True)
            try:
                for _ in range(steps):
                    case.step()
            finally:
                if lane_timing is not None:
                    spent["kernels"][0] += lane_timing(False) / 1e9
    out = {f"{name}_us": 1e6 * spent[name][0] / max(1, spent[name][1]) for name in ("pack", "unpack")}
    if case.device == "cpu":
        hooks = spent["pack"][0] + spent["unpack"][0] - spent["kernels"][0]
        out["host_us"] = 1e6 * hooks / (steps * BLOCKS * 2)  # the MLP's compressed saves: two a block
    return out


@contextlib.contextmanager
def _hooks_timed(pack: Callable, unpack: Callable, timed: Callable) -> Iterator[None]:
    """The hooks on top, ``pack`` and ``unpack``, timed as ``timed("pack", ...)`` and ``timed("unpack", ...)`` for the
    block. gactx's (a ``HookGraph`` pair, compiled.py) are timed in place, through the function each calls eagerly,
    so that they stay on top as a training loop has them: under a pair of ours a controller's pass begins unwatched,
    and before it began none (the pass's first save then took the whole path). The floor's are timed from a pair on
    top."""
    if not hasattr(pack, "eager"):
        with torch.autograd.graph.saved_tensors_hooks(timed("pack", pack), timed("unpack", unpack)):
            yield
        return
    eager = pack.eager, unpack.eager
    pack.eager, unpack.eager = timed("pack", eager[0]), timed("unpack", eager[1])
    try:
        yield
    finally:
        pack.eager, unpack.eager = eager


@contextlib.contextmanager
def _kernels_timed(timed: Callable | None) -> Iterator[None]:
    """Each function of gactx's built C++ extension, and each call of its classes' objects (``__call__``, ``unpack``),
    replaced by ``timed("kernels", fn)`` for the block (``None``: nothing replaced). The kernels' Python wrappers look
    their function up at each call."""
    built = cpu.built
    if timed is None or built is None:
        yield
        return
    names = [n for n in dir(built) if not n.startswith("_") and callable(getattr(built, n))]
    functions = {n: getattr(built, n) for n in names if not isinstance(getattr(built, n), type)}
    # The classes' calls: a replayed save's C++ handle, made by a packer's call and read by its unpack.
    methods = {(c, m): c.__dict__[m] for c in map(built.__dict__.get, names) if isinstance(c, type)
               for m in ("__call__", "unpack") if m in c.__dict__}  # fmt: skip
    for n, fn in functions.items():
        setattr(built, n, timed("kernels", fn))
    for c, m in methods:
        setattr(c, m, timed("kernels", getattr(c, m)))
    try:
        yield
    finally:
        for n, fn in functions.items():
            setattr(built, n, fn)
        for (c, m), fn in methods.items():
            setattr(c, m, fn)


def methods(
    compiled: bool, cpp: bool, traced: bool, only: tuple[str, ...] | None = None, device: str = "cpu"
) -> list[str]:
    """The cases :func:`measure` times, each method after the plain one it is compared with (:func:`base_of`);
    ``only``: of them, these methods, eager L1 (whose records count the saves) and their plain ones. The native
    method runs on a CPU where the recording driver builds (on a GPU it is L1), the launcher method on a GPU."""
    other = LAUNCHER if device == "cpu" else NATIVE
    if device == "cpu" and (native.unavailable() or not driver_buildable()):
        other = (LAUNCHER, NATIVE)  # no recording driver here: no native method
    names = ["plain", *(m for m in METHODS if (compiled or "+compile" not in m) and (cpp or CPP_WRAPPER not in m)
                        and (traced or TORCH_BACKEND not in m) and not m.endswith(other))]  # fmt: skip
    if compiled:
        names.insert(names.index("L0+compile"), "plain+compile")
    if compiled and cpp:
        names.insert(names.index("L1+compile-cpp"), "plain+compile-cpp")
    if only is not None:
        kept = {"L1", *only}
        kept |= {base_of(m) for m in kept}
        names = [n for n in names if n in kept]
    return names


def base_of(name: str) -> str:
    """The plain case a method is compared with: compiled plain for a compiled one (compiled alike: with the C++
    wrapper for one that has it; gactx's backend is no plain's concern)."""
    if "+compile" not in name:
        return "plain"
    return "plain" + name[name.index("+") :].removesuffix(TORCH_BACKEND)


def measure(
    width: int, device: str, rounds: int, steps: int, compiled: bool = True, cpp: bool = False, traced: bool = False,
    only: tuple[str, ...] | None = None,
) -> list[dict]:  # fmt: skip
    """Rows of one width: plain, then each method, with their medians, ratios and per-save figures (``cpp``: the
    methods compiled with Inductor's C++ wrapper too; ``traced``: L1 compiled with ``backend="torch"`` too; ``only``:
    those methods alone, as :func:`methods` keeps them)."""
    torch._dynamo.reset()  # each width's graphs on their own
    cases = {name: Case(name, width, device) for name in methods(compiled, cpp, traced, only, device)}
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    with fresh():  # graphs compiled now: Inductor's cache may hold code that another gactx wrote for the same graph
        for case in cases.values():  # warm-up: compilation, the op watcher's pass, the CPU kernels' build
            case.turn(3)
    times = alternate({name: (lambda case=case: case.turn(steps)) for name, case in cases.items()}, rounds)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    saves = cases["L1"].saves()  # compressed saves a step, as L1's last pass recorded them
    rows = []
    for name, case in cases.items():
        base = base_of(name)
        row = {"width": width, "method": name, "step_ms": median[name], "vs_plain": median[name] / median[base],
               "saves": saves, "per_save_us": 1e3 * (median[name] - median[base]) / saves,
               "python_calls_per_save": python_calls(case) / saves}  # fmt: skip
        plain_launches, own = launches(cases[base]), launches(case)
        if own is not None:
            row["launches_per_save"] = (own - plain_launches) / saves
        if name in ("L0", "L1", "L0+compile", "L1+compile"):
            row["part"] = "hooks and bookkeeping" if name.startswith("L0") else "compression"
        if name in ("floor", "L1", "L1-native", "L1-launcher", "L1.1"):
            row.update(hook_us(case, steps))
        rows.append(row)
    by = {r["method"]: r for r in rows}
    for suffix in ("", "+compile"):
        if f"L1{suffix}" in by and f"L0{suffix}" in by:  # compression alone: L1 against L0
            by[f"L1{suffix}"]["compression_us"] = by[f"L1{suffix}"]["per_save_us"] - by[f"L0{suffix}"]["per_save_us"]
    return rows


def render(rows: list[dict], env: dict) -> str:
    lines = [f"# gactx host cost a saved tensor on {env['device_name']}", "",
             f"- torch {env['torch']}; run {env['date']}; {env['threads']} torch thread(s); "
             f"median of {env['rounds']} rounds of {env['steps']} steps, methods in turns",
             f"- model: {BLOCKS} x (Linear(w, w) + GELU), batch w: 16 compressed saves a step; "
             "eager methods against plain, compiled ones against compiled plain"]  # fmt: skip
    if env["device"] == "cpu" and any(r["method"].endswith(NATIVE) for r in rows):
        lines.append(f"- L1{NATIVE}: L1's saves packed by launches from C++ into a recording driver in place of the "
                     "CUDA driver (benchmarks/driver), which records each launch and runs no kernel: its step leaves "
                     "the kernels' work out, and its hooks' host time counts the launches as host work")  # fmt: skip
    lines.append("")
    headers = ["w", "method", "step ms", "vs plain", "us a save", "compression us a save", "pack us", "unpack us",
               "hooks' host us a save", "Python calls a save", "launches a save"]  # fmt: skip
    cells = [[r["width"], r["method"], f"{r['step_ms']:.3f}", f"{r['vs_plain']:.2f}x", _f(r.get("per_save_us")),
              _f(r.get("compression_us")), _f(r.get("pack_us")), _f(r.get("unpack_us")), _f(r.get("host_us")),
              _f(r.get("python_calls_per_save")), _f(r.get("launches_per_save"))] for r in rows]  # fmt: skip
    return "\n".join(lines + markdown_table(headers, cells, left=2)) + "\n"


def _f(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def run(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("host", __doc__, quick="width 64, 2 rounds of 3 steps")
    p = bench.parser
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20, help="steps a method's turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--no-compile", action="store_true", help="eager methods only")
    p.add_argument("--no-cpp-wrapper", action="store_true", help="leave out the methods compiled with Inductor's C++ "
                   "wrapper (their compile takes about 30 s a graph; --quick leaves them out)")  # fmt: skip
    p.add_argument("--no-torch-backend", action="store_true", help="leave out L1 compiled with backend=\"torch\" (its "
                   "compile takes longer; --quick leaves it out)")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = bench.parse(argv)
    if args.quick:
        args.widths, args.rounds, args.steps = [64], 2, 3
    torch.set_num_threads(args.threads)
    env = bench.environment(args.device, rounds=args.rounds, steps=args.steps)
    compiled, cpp = not args.no_compile, not (args.no_cpp_wrapper or args.quick)
    traced = not (args.no_torch_backend or args.quick)
    rows = [r for w in args.widths for r in measure(w, args.device, args.rounds, args.steps, compiled, cpp, traced)]
    table = render(rows, env)
    folder = bench.folder(args, args.device)
    bench.write(folder, env, rows, table, indent=1)
    print(table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    run()
