"""Levels and options: a frozen :class:`Config`, the levels table, and the global default level."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from gactx.kernels import ALLOWED_BITS, BACKENDS, GROUP_SIZES

__all__ = ["Config", "LEVELS", "PLANNED_LEVELS", "make_config", "set_optimization_level", "get_optimization_level"]

# GACT's names, kept for people who come from it. ``bits=None`` means "compress nothing".
LEVELS: dict[str, dict] = {
    "L0": {"bits": None},
    "L1": {"bits": 4},
    "L1.1": {"bits": 8},
    "L1.2": {"bits": 2},
}
# Known to users of GACT, not available yet: asking for them is an error that says so.
PLANNED_LEVELS = {
    "L2": "adaptive bits (average 4)",
    "L2.1": "adaptive bits (average 3)",
    "L2.2": "adaptive bits (average 2)",
    "L3": "adaptive bits with CPU offload",
}

_default_level = "L1"


@dataclass(frozen=True)
class Config:
    """What a :class:`gactx.Controller` does with each saved tensor.

    Attributes:
        level: the level the other fields came from (``"L0"``, ``"L1"``, ``"L1.1"``, ``"L1.2"``).
        bits: bits of every compressed tensor (1, 2, 4, 8, 16 or 32), or ``None`` to compress nothing.
        group_size: elements that share a scale, see :func:`gactx.quantize`.
        min_numel: tensors with fewer elements are kept as they are (4 KiB of float32 gains nothing
            worth a kernel launch and 8 bytes of metadata a group).
        stochastic: stochastic rounding (unbiased) or round half up.
        dedupe: store a tensor saved several times in one forward (Q, K, V inputs) once.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, see :func:`gactx.quantize`.
        seed: base seed of the rounding noise; each tensor's noise depends on it, the step and the key.
    """

    level: str = "L1"
    bits: int | None = 4
    group_size: int = 256
    min_numel: int = 1024
    stochastic: bool = True
    dedupe: bool = True
    backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} is not available; available levels are {tuple(LEVELS)}")
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in ALLOWED_BITS):
            raise ValueError(f"bits={self.bits!r} is not allowed; allowed values are None or {ALLOWED_BITS}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is not allowed; allowed values are {GROUP_SIZES}")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel={self.min_numel!r} must be a non-negative int")
        for name in ("stochastic", "dedupe"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not allowed; allowed values are {BACKENDS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative int")


def _check_level(level: str) -> str:
    if level in PLANNED_LEVELS:
        raise ValueError(
            f"level {level!r} ({PLANNED_LEVELS[level]}) is not available in this version; "
            f"available levels are {tuple(LEVELS)}"
        )
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


def make_config(level: str | None = None, **options) -> Config:
    """The level's settings, then ``options`` on top (options win). Unknown options raise ``TypeError``."""
    level = _check_level(_default_level if level is None else level)
    known = {f.name for f in fields(Config)} - {"level"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; options are {', '.join(sorted(known))}")
    return replace(Config(level=level, **LEVELS[level]), **options)
