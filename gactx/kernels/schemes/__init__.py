"""Storage schemes: the ways an allocated tensor may be stored, each one module and one line of the registry below.

A :class:`Choice` is a width and a scheme (and the scheme's parameters: a sketch's fraction of rows, per-sample widths'
fraction and high width). A :class:`Scheme` answers everything the rest of gactx asks of one:

- ``measure(x, flat, group_size, sketchable)``: the expected squared error of storing ``x`` under each choice it
  offers, as device tensors (no host read: it runs inside the pack hook while an estimator measures): a mapping from
  choice to a 0-d tensor, or a :class:`Measured` (the choices and one tensor of their errors, which the choices'
  meter reads whole);
- ``options(choice, error, measured, scale)``: the allocator's options a measured choice stands for (a sketch's
  sampling error stands for its kept rows at every code width);
- ``nbytes(shape, dtype, choice, group_size)``: the bytes it stores;
- ``encode(t, choice, seed, group_size, stochastic, backend, sketchable)``: what it stores (a ``Stored``: ``nbytes``
  and ``decode()``), or ``None`` where it does not apply to this save (then uniform codes are stored);
- ``label(choice)``, ``form(choice)``, ``effective_bits(choice)``, ``fallback_bits(choice)``: how a choice reads in
  reports and records, and its width where it does not apply;
- ``kernel_specs()``: its Triton kernels' ahead-of-time compile specs by family (``gactx/kernels/aot.py`` collects
  them; none for a scheme of torch ops alone).

Adding a scheme is a module (or a folder: ``uniform/``, ``normal/``) with a :class:`Scheme` subclass and a
:func:`register` call (a test registers one:
``tests/kernels/schemes/test_registry.py``). The allocation offers it once a controller's ``schemes=`` names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import torch

__all__ = ["CODE_WIDTHS", "Choice", "Measured", "Scheme", "Stored", "names", "register", "scheme", "unregister"]

CODE_WIDTHS = (1, 2, 4, 8)  # the widths of codes on a grid (16: bfloat16, 32: as is)


class Stored(Protocol):
    """What a scheme stores for a tensor."""

    @property
    def nbytes(self) -> int: ...

    def decode(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Choice:
    """One way to store an allocated tensor: ``bits`` per stored element under ``scheme``; a sketch stores
    ``fraction`` of the rows; per-sample widths store ``fraction`` of the samples at ``high`` bits."""

    bits: int
    scheme: str = "uniform"
    fraction: float = 1.0
    high: int = 0
    complement: bool = False  # a sketch of the rows its seed does not choose: only GACT's estimator stores one

    def __str__(self) -> str:
        found = _registry().get(self.scheme)
        return found.label(self) if found is not None else f"{self.bits} {self.scheme}"

    @property
    def share(self) -> Fraction:
        """:attr:`fraction` as the nearest fraction of denominator at most 2**16 (what reports print)."""
        return Fraction(self.fraction).limit_denominator(1 << 16)

    @property
    def effective_bits(self) -> float:
        """Bits an element of the whole tensor, metadata aside."""
        return scheme(self.scheme).effective_bits(self)

    @property
    def fallback_bits(self) -> int:
        """The uniform width stored where the scheme does not apply to a save (a sketch of a tensor that is no
        longer a linear layer's input)."""
        return scheme(self.scheme).fallback_bits(self)


class Measured(Mapping):
    """What a scheme measured in one piece: its ``choices`` and a 1-D tensor of their ``errors``, in that order. A
    mapping from choice to a 0-d tensor like any ``measure`` result; the choices' meter reads ``errors`` whole, with no
    view a choice (eight views cost a small tensor's measurement again)."""

    __slots__ = ("choices", "errors")

    def __init__(self, choices: tuple[Choice, ...], errors: torch.Tensor) -> None:
        self.choices, self.errors = choices, errors

    def __getitem__(self, choice: Choice) -> torch.Tensor:
        try:
            return self.errors[self.choices.index(choice)]
        except ValueError:
            raise KeyError(choice) from None

    def __iter__(self) -> Iterator[Choice]:
        return iter(self.choices)

    def __len__(self) -> int:
        return len(self.choices)


class Scheme:
    """One storage scheme (the module docstring); the defaults suit a scheme that stores every element at the
    choice's width."""

    name: str = ""
    derived: bool = False  # its options are made from other schemes' measurements (listed after theirs)

    def measure(
        self, x: torch.Tensor, flat: torch.Tensor, group_size: int, sketchable
    ) -> Mapping[Choice, torch.Tensor]:
        """The expected squared error of storing ``x`` (``flat``: its values in memory order, contiguous) under each
        choice this scheme offers (a dict, or a :class:`Measured`); ``sketchable()``: whether the save feeds only a
        weight's gradient."""
        raise NotImplementedError

    def options(self, choice: Choice, error: float, measured: dict[Choice, float], scale: float) -> dict[Choice, float]:
        """The allocator's choices that the measured ``choice`` (its stored error ``error``) stands for, with their
        errors; ``scale``: the sketch calibration (``choices.calibration``)."""
        return {choice: error}

    def nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, choice: Choice, group_size: int) -> int:
        raise NotImplementedError

    def encode(
        self, t: torch.Tensor, choice: Choice, seed: int, group_size: int, stochastic: bool, backend: str,
        sketchable: bool,
    ) -> Stored | None:  # fmt: skip
        raise NotImplementedError

    def label(self, choice: Choice) -> str:
        return f"{choice.bits} {self.name}"

    def form(self, choice: Choice) -> str:
        """What a record says of a tensor stored under ``choice`` (beside its width)."""
        return self.name

    def effective_bits(self, choice: Choice) -> float:
        return choice.bits * choice.fraction

    def fallback_bits(self, choice: Choice) -> int:
        return choice.bits

    def kernel_specs(self) -> dict:
        """Its Triton kernels' ahead-of-time compile specs, by family: ``{family: specs(bits=None)}`` (its folder's
        ``specs.py``; ``aot.py`` collects every registered scheme's). None for a scheme of torch ops alone."""
        return {}


# The built-in schemes: one line each, "module:class", imported on first use (their modules import the kernels, which
# import the normal scheme's folder, which is inside this package).
_BUILT_IN = {
    "uniform": "gactx.kernels.schemes.uniform.scheme:UniformScheme",
    "normal": "gactx.kernels.schemes.normal.scheme:NormalScheme",
    "sketch": "gactx.kernels.schemes.sketch:SketchScheme",
    "samples": "gactx.kernels.schemes.samples:SamplesScheme",
}
_REGISTRY: dict[str, Scheme] = {}
_loaded = False


def _registry() -> dict[str, Scheme]:
    """The registry, the built-in schemes loaded on first use (before any other: ``register`` asks for it first)."""
    global _loaded
    if not _loaded:
        for name, where in _BUILT_IN.items():
            module, cls = where.split(":")
            _REGISTRY[name] = getattr(importlib.import_module(module), cls)()
        _loaded = True
    return _REGISTRY


def register(s: Scheme) -> Scheme:
    """Add ``s`` under ``s.name`` (a name already registered: ``ValueError``)."""
    registry = _registry()
    if not s.name or s.name in registry:
        raise ValueError(f"scheme name {s.name!r} is empty or registered already; registered: {names()}")
    registry[s.name] = s
    return s


def unregister(name: str) -> None:
    """Remove a scheme (the built-in ones stay: ``ValueError``)."""
    registry = _registry()
    if name in _BUILT_IN or name not in registry:
        raise ValueError(f"scheme {name!r} is built in or not registered; registered: {names()}")
    del registry[name]


def scheme(name: str) -> Scheme:
    found = _REGISTRY.get(name) or _registry().get(name)
    if found is None:
        raise ValueError(f"scheme {name!r} is not registered; registered: {names()}")
    return found


def names() -> tuple[str, ...]:
    """The registered schemes' names, in registration order (the built-in ones first)."""
    return tuple(_registry())
