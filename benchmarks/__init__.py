"""Benchmarks of gactx: kernel throughput (``python -m benchmarks.kernels``). Not part of the installed package."""

__all__: list[str] = []
