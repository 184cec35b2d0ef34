"""Benchmarks of gactx: kernels (``python -m benchmarks.kernels``), models (``python -m benchmarks.run``), the demo.

Not part of the installed package."""

import os

# The CPU peak meter runs torch's profiler, whose Kineto library writes two lines to stderr at every start and stop
# (level USDT, above its errors): through a progress bar. Quiet unless the environment asks for a level.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

__all__: list[str] = []
