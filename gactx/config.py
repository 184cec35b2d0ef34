"""Levels and options: a frozen :class:`Config`, the levels table, and the global default level."""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, fields

import torch

from gactx.kernels import ALLOWED_BITS, BACKENDS, GROUP_SIZES, schemes

__all__ = [
    "Config",
    "LEVELS",
    "get_optimization_level",
    "make_config",
    "parse_bytes",
    "set_optimization_level",
]

# GACT's names, kept for people who come from it. ``bits=None`` means "compress nothing"; at the adaptive
# levels ``bits`` is the average width the budget allows.
LEVELS: dict[str, dict] = {
    "L0": {"bits": None},
    "L1": {"bits": 4},
    "L1.1": {"bits": 8},
    "L1.2": {"bits": 2},
    "L2": {"bits": 4, "adaptive": True},
    "L2.1": {"bits": 3, "adaptive": True},
    "L2.2": {"bits": 2, "adaptive": True},
    "L3": {"bits": 4, "adaptive": True, "offload": True},
}

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20}
_UNITS |= {"GIB": 1 << 30, "TIB": 1 << 40}

_default_level = "L1"
OP_RULES = ("learn", "always", "off")
ESTIMATORS = ("gact", "actnn")
OBJECTIVES = ("gradient", "update")  # what the "gact" estimator's allocation keeps small (Config.objective)
# The schemes offered where none are given, by estimator: ActNN's measures no sketch (docs/adaptive.md).
DEFAULT_SCHEMES = {"gact": ("uniform", "normal", "sketch"), "actnn": ("uniform", "normal")}
CHECKPOINT_BITS = (2, 4, 8, 16)  # widths of a checkpointed region's inputs (None: kept)


@dataclass(frozen=True)
class Config:
    """What a :class:`gactx.Controller` does with each saved tensor.

    Attributes:
        level: the level the other fields came from (``"L0"``, ``"L1"``, ``"L1.1"``, ``"L1.2"``, ``"L2"``, ...).
        bits: fixed levels: bits of every compressed tensor (1, 2, 4, 8, 16 or 32), or ``None`` to compress
            nothing. Adaptive levels: the average width of the budget (any number from 1 to 32, e.g. 2.5).
        adaptive: choose bits per tensor from measured sensitivities under the budget.
        budget: adaptive only: bytes that gactx may hold for the saved activations of one forward pass,
            metadata and tensors kept as they are included (an int, or a string such as ``"1.5GiB"``);
            it replaces the average-bits budget.
        adapt_interval: adaptive only: re-estimate sensitivities after the first step and every this many.
        adapt_backoff: adaptive only: while an adaptation finds that the allocation it replaces was within 10% of the
            new one's predicted gradient variance, the interval to the next doubles, up to this many times
            ``adapt_interval`` (an adaptation that gains more brings it back; see docs/adaptive.md). 1: a fixed
            interval.
        estimator: adaptive only: how sensitivities are measured (see docs/adaptive.md). ``"gact"`` measures each of
            ``L`` compressed tensors in a pass of its own against an exact base, about ``2 + L`` passes of the
            ``backprop`` closure, of which all but two replay its backward only (GACT's estimator); ``"actnn"``
            reads each tensor's group ranges and the gradient reaching its module during the ordinary step
            before an adaptation (ActNN's estimate: no extra pass, no closure needed).
        probe_bits: adaptive only: the width at which the ``"gact"`` estimator perturbs one tensor at a time.
        objective: adaptive only, ``"gact"`` estimator: what the allocation keeps small. ``"gradient"`` (default):
            the whole gradient's squared error (GACT's), where a parameter whose gradient is small counts for little;
            ``"update"``: the error each parameter's gradient carries relative to that gradient's own size, as an
            optimizer that scales each parameter's step (Adam, AdamW) sees it (see docs/adaptive.md#objective).
        schemes: adaptive only: the ways the allocator may store a tensor, chosen per tensor by measured variance
            per byte (see docs/adaptive.md): ``"uniform"`` (codes on the group's min-max grid; always included),
            ``"normal"`` (codes on levels fitted to the group's normal, after SmaQ), ``"sketch"`` (a fraction of
            the rows of a linear layer's input, after FewBit's randomized linear) and ``"samples"`` (per-sample
            widths: the samples of widest range at a wider width, after ActNN). Default (``None``): uniform,
            normal and sketch with GACT's estimator, each chosen where its measured variance per byte wins
            (docs/adaptive.md, "Storage choices"); uniform and normal with ActNN's, which does not measure what a
            sketch adds (asked for, a sketch is priced on its prediction alone, with a warning). Per-sample widths
            are rarely chosen and cost a transient copy, so they are opt-in.
        strict: adaptive only: a budget that even 1-bit codes exceed raises ``ValueError`` instead of a
            warning (then the narrowest widths are used).
        group_size: elements that share a scale, see :func:`gactx.quantize`.
        min_numel: tensors with fewer elements are kept as they are (4 KiB of float32 gains nothing
            worth a kernel launch and 8 bytes of metadata a group).
        stochastic: stochastic rounding (unbiased) or round half up.
        dedupe: store a tensor saved several times in one forward (Q, K, V inputs) once.
        backend: ``"auto"``, ``"triton"``, ``"cpp"`` or ``"torch"``, see :func:`gactx.quantize`.
        seed: base seed of the rounding noise; each tensor's noise depends on it, the step and the key.
        offload: keep compressed CUDA tensors in pinned CPU memory between forward and backward, copied on a
            side stream and prefetched in backward (level L3; any level with compression may set it).
            Tensors on other devices stay where they are (with a warning).
        prefetch: offload only: how many tensors ahead backward brings back to the device.
        op_rules: how the op that saved each tensor is learned (see docs/levels.md#what-each-saved-tensor-gets):
            ``"learn"`` watches the aten ops of a forward pass after one that met a save not seen before and
            keeps what it learned per slot; ``"always"`` watches every forward pass (an op's scalar
            arguments, a clamp bound say, are then never stale; a Python call an op of host time); ``"off"``
            never watches: only saved results name their op (through their ``grad_fn``), inputs are
            quantized as linear inputs (GACT's behaviour).
        checkpoint_bits: the width of a non-reentrant checkpoint's region inputs (the hidden states between
            checkpointed layers; 2, 4, 8 or 16 bits), from which backward recomputes each region, or ``None`` to keep
            them as they are (see docs/llm.md). Recomputing from a decoded input is not unbiased as other saves are
            (the region runs on a slightly different input), so this width is chosen apart, by measurement.
    """

    level: str = "L1"
    bits: float | None = 4
    adaptive: bool = False
    budget: int | str | None = None
    adapt_interval: int = 1000
    adapt_backoff: int = 8
    estimator: str = "gact"
    probe_bits: int = 2
    objective: str = "gradient"
    schemes: tuple[str, ...] | None = None  # None: DEFAULT_SCHEMES[estimator]
    strict: bool = False
    group_size: int = 256
    min_numel: int = 1024
    stochastic: bool = True
    dedupe: bool = True
    backend: str = "auto"
    seed: int = 0
    offload: bool = False
    prefetch: int = 2
    op_rules: str = "learn"
    checkpoint_bits: int | None = 8

    @classmethod
    def for_level(cls, level: str | None = None, **options) -> Config:
        """The settings of ``level`` (``None``: the level set with :func:`set_optimization_level`), with
        ``options`` on top: what ``Controller(model, level, **options)`` uses. (``Config(...)`` itself takes
        every field as given: its defaults are L1's.)"""
        return make_config(level, **options)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} is not available; available levels are {tuple(LEVELS)}")
        for name in ("adaptive", "strict", "stochastic", "dedupe", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.adaptive:
            if isinstance(self.bits, bool) or not isinstance(self.bits, int | float) or not 1 <= self.bits <= 32:
                raise ValueError(f"bits={self.bits!r}: at an adaptive level bits is an average width from 1 to 32")
            if self.budget is not None:
                parse_bytes(self.budget)
        else:
            if self.bits is not None and (not _is_int(self.bits) or self.bits not in ALLOWED_BITS):
                raise ValueError(f"bits={self.bits!r} is not allowed; allowed values are None or {ALLOWED_BITS}")
            if self.budget is not None:
                raise ValueError(f"budget={self.budget!r} needs an adaptive level (L2, L2.1, L2.2, L3)")
        if isinstance(self.adapt_interval, bool) or not isinstance(self.adapt_interval, int) or self.adapt_interval < 1:
            raise ValueError(f"adapt_interval={self.adapt_interval!r} must be an int >= 1")
        if isinstance(self.adapt_backoff, bool) or not isinstance(self.adapt_backoff, int) or self.adapt_backoff < 1:
            raise ValueError(f"adapt_backoff={self.adapt_backoff!r} must be an int >= 1 (1: a fixed interval)")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r} is not allowed; allowed values are {ESTIMATORS}")
        if isinstance(self.schemes, list):  # a list reads as well; the frozen field keeps a tuple
            object.__setattr__(self, "schemes", tuple(self.schemes))
        if self.schemes is None:
            object.__setattr__(self, "schemes", DEFAULT_SCHEMES.get(self.estimator, DEFAULT_SCHEMES["gact"]))
        elif self.adaptive and self.estimator == "actnn" and "sketch" in self.schemes:
            warnings.warn(
                "gactx: estimator='actnn' does not measure what a sketch adds to the gradient, so sketches are priced "
                "on their prediction alone; estimator='gact' measures them (docs/adaptive.md#estimators)",
                RuntimeWarning,
                stacklevel=_caller_level(),
            )
        if (
            not isinstance(self.schemes, tuple)
            or "uniform" not in self.schemes
            or any(s not in schemes.names() for s in self.schemes)
            or len(set(self.schemes)) != len(self.schemes)
        ):
            raise ValueError(
                f"schemes={self.schemes!r} must be a tuple of distinct names from {schemes.names()} (the registered "
                "storage schemes) that includes 'uniform'"
            )
        if not _is_int(self.probe_bits) or self.probe_bits not in (1, 2, 4, 8):
            raise ValueError(f"probe_bits={self.probe_bits!r} is not allowed; allowed values are (1, 2, 4, 8)")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is not allowed; allowed values are {OBJECTIVES}")
        if not _is_int(self.group_size) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is not allowed; allowed values are {GROUP_SIZES}")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel={self.min_numel!r} must be a non-negative int")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not allowed; allowed values are {BACKENDS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative int")
        if self.op_rules not in OP_RULES:
            raise ValueError(f"op_rules={self.op_rules!r} is not allowed; allowed values are {OP_RULES}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch!r} must be a non-negative int")
        if self.checkpoint_bits is not None and (not _is_int(self.checkpoint_bits) or
                                                 self.checkpoint_bits not in CHECKPOINT_BITS):  # fmt: skip
            raise ValueError(
                f"checkpoint_bits={self.checkpoint_bits!r} is not allowed; allowed values are None or {CHECKPOINT_BITS}"
            )


def _is_int(value) -> bool:
    """An int, not a bool (True == 1) nor a float that equals one (2.0 == 2)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_bytes(budget: int | str) -> int:
    """``1536``, ``"1.5GiB"``, ``"512 MiB"``, ``"2GB"`` -> bytes. Raises ``ValueError`` naming the units."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        if budget < 0:
            raise ValueError(f"budget={budget!r} must not be negative")
        return budget
    if isinstance(budget, str):
        text = budget.strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                try:
                    value = float(text[: -len(unit)])
                except ValueError:
                    break
                if math.isfinite(value) and value >= 0:
                    return int(value * _UNITS[unit])
                break
    units = ", ".join(u.replace("I", "i") for u in _UNITS)
    raise ValueError(f"budget={budget!r} is not a byte count: give an int or a number with a unit ({units})")


def _check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; available levels are {tuple(LEVELS)}")
    return level


def set_optimization_level(level: str) -> None:
    """Set the level that a :class:`gactx.Controller` built without ``level=`` uses (GACT's global style)."""
    global _default_level
    _default_level = _check_level(level)


def get_optimization_level() -> str:
    """The level set by :func:`set_optimization_level` (``"L1"`` unless changed)."""
    return _default_level


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside gactx and torch (a dataclass's generated ``__init__`` is inside),
    for a warning issued in a function that calls this: it points at the user's line, also from a hook that torch's
    autograd or a module's forward called."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename.startswith(_INSIDE) or frame.f_code.co_filename[0] == "<"):
        frame, level = frame.f_back, level + 1
    return level


_INSIDE = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], torch))


def make_config(level: str | None = None, **options) -> Config:
    """The level's settings, then ``options`` on top (options win). Unknown options raise ``TypeError``."""
    level = _check_level(_default_level if level is None else level)
    known = {f.name for f in fields(Config)} - {"level"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; options are {', '.join(sorted(known))}")
    return Config(level=level, **{**LEVELS[level], **options})  # one construction: a default resolves once
