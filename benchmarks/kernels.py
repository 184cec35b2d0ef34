"""The kernels benchmark.

    python -m benchmarks.kernels [--gpu h100 h200 a100] [--quick] [--out DIR]   # compiled kernels, a named GPU
    python -m benchmarks.kernels --throughput [--quick] [--out DIR] [...]       # GB/s against torch.clone, here

Both write to ``benchmarks/runs/<device>/`` (git-ignored) unless ``--out DIR`` names a folder; ``--update-results``
writes the committed ``benchmarks/results/<device>/`` (``make bench-kernels``).

The first (``roofline.py``) needs no GPU: registers, instructions and bytes an element, and roofline times,
read from the kernels compiled for the GPU's architecture; measured times beside them where a GPU is here.
The second (``throughput.py``) times ``gactx.quantize`` and ``gactx.dequantize`` on this machine's device.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the gactx of this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import roofline, throughput  # noqa: E402

__all__ = ["run"]


def run(argv: list[str] | None = None):
    """``--throughput`` and its options: the throughput sweep (its rows); otherwise the roofline tables."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--throughput" in argv:
        return throughput.run([a for a in argv if a != "--throughput"])
    if "-h" in argv or "--help" in argv:  # the two forms first: the roofline's help below knows only its own options
        print(__doc__.split("\n\n", 2)[1] + "\n\nThe roofline's options (--throughput --help: the sweep's):\n")
    return roofline.run(argv)


if __name__ == "__main__":
    run()
