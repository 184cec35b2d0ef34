"""The demo: train real models with and without gactx on the default device and print what was saved.

    python -m benchmarks.demo

For now it trains a CNN on scikit-learn's digits (it ships with the package: nothing is downloaded) at full
precision and at the fixed-bit levels, and prints test accuracy, the last loss, the saved-activation bytes
of one step, the compression ratio and the time taken.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.digits import train_digits
from benchmarks.kernels import device_name
from gactx.controller.stats import format_bytes


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--levels", nargs="+", default=["L1.1", "L1", "L1.2", "L2.2"])
    args = parser.parse_args(argv)
    device = device_name("cuda" if torch.cuda.is_available() else "cpu")
    print(f"gactx demo on {device}, torch {torch.__version__}: digits CNN, {args.epochs} epochs\n")
    header = f"{'run':<16}{'accuracy':>9}{'loss':>9}{'activations':>14}{'gactx holds':>14}{'ratio':>8}{'time':>8}"
    print(header)
    print("-" * len(header))
    runs = []
    for level in [None, *args.levels]:
        run = train_digits(level, epochs=args.epochs)
        runs.append(run)
        name = "full precision" if level is None else f"gactx {level}"
        m = run.memory
        print(
            f"{name:<16}{run.accuracy:>9.2%}{run.loss:>9.4f}{format_bytes(m.original_bytes):>14}"
            f"{format_bytes(m.packed_bytes):>14}{m.ratio:>7.1f}x{run.seconds:>7.1f}s"
        )
    return runs


if __name__ == "__main__":
    main()
