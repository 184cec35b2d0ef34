"""The torch versions gactx supports, checked when gactx is imported (docs/install.md#supported-versions): an older
torch is refused with a clear error rather than failing deep inside autograd or torch.compile."""

from __future__ import annotations

import re

import torch

TORCH = (2, 9)  # the oldest torch supported; under 2.9 compiled regions are not compressed (docs/torch-compile.md)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.9.1+cu128"`` -> ``(2, 9, 1)``, ``"2.13.0.dev20261101"`` ->
    ``(2, 13, 0)``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def check(version: str = torch.__version__) -> None:
    """Raise ``ImportError`` where ``version`` (torch's) is older than :data:`TORCH`."""
    if release(version) < TORCH:
        raise ImportError(
            f"gactx needs torch {'.'.join(map(str, TORCH))} or later; this is torch {version} "
            "(see docs/install.md#supported-versions)"
        )


check()
