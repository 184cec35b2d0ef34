"""Benchmarks of gactx: kernels (``python -m benchmarks.kernels``), models (``python -m benchmarks.run``), the demo.

Not part of the installed package."""

__all__: list[str] = []
