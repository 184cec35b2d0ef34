"""The benchmarks' one harness: every benchmark is a command with the same options and guard, one environment record,
results written the same way, and one timer that alternates the runs it compares.

    bench = Bench("host", __doc__)                      # python -m benchmarks.host, with --out and --quick
    bench.parser.add_argument("--rounds", ...)          # the benchmark's own options
    args = bench.parse(argv)                            # --quick without --out is refused (the guard)
    env = bench.environment(device, rounds=args.rounds) # device name, torch, threads, date, and its own fields
    times = alternate({"plain": plain.turn, "L1": l1.turn}, rounds=7)
    bench.write(results_folder(args.out, device), env, rows, table)  # host.json, host.md, host.csv

Results go to ``benchmarks/results/<device>/`` unless ``--out`` names a folder: ``<name>.json`` (the environment and
the rows, and any other parts a benchmark keeps), ``<name>.md`` (its table) and ``<name>.csv`` (the rows, one line
each). ``--quick`` runs a smoke test's sizes, and only into a folder given with ``--out``, so that the committed
results are never overwritten by a smoke test's figures.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.device import device_name, device_slug

__all__ = ["Bench", "alternate", "kept_rows", "now", "read_results", "results_folder", "summary", "write_csv"]

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_GUARD = "--quick writes a smoke test's figures: give --out, the committed results stay as they are"


def summary(doc: str) -> str:
    """A module docstring's first paragraph on one line: a command's ``--help`` description, whole."""
    return " ".join((doc or "").split("\n\n")[0].split())


def now() -> str:
    """The date results are stamped with (UTC, to the minute)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class Bench:
    """One benchmark's command: ``python -m benchmarks.<name>``, its parser with ``--out`` and ``--quick`` (``quick``:
    what a smoke test runs; ``None``: no quick mode), its environment record and its results."""

    def __init__(self, name: str, doc: str | None, quick: str | None = "tiny sizes", **parser_options) -> None:
        self.name = name
        parser_options.setdefault("prog", f"python -m benchmarks.{name}")
        parser_options.setdefault("description", summary(doc or ""))
        self.parser = argparse.ArgumentParser(**parser_options)
        self.parser.add_argument("--out", type=Path, help="results folder; default benchmarks/results/<device>/")
        self.quick = quick is not None
        if self.quick:
            self.parser.add_argument("--quick", action="store_true", help=f"{quick}: a smoke test (needs --out)")

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """The command line, with the guard: a smoke test writes only where ``--out`` says."""
        args = self.parser.parse_args(argv)
        if self.quick and args.quick and args.out is None:
            self.parser.error(QUICK_GUARD)
        return args

    def environment(self, device: str, **fields) -> dict:
        """What every result records: the device (its name and folder), torch's version and threads, the date, and
        the benchmark's own ``fields``."""
        return {"device": device_slug(device), "device_name": device_name(device), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "date": now(), **fields}  # fmt: skip

    def write(self, folder: Path, env: dict, rows: list[dict], table: str, indent: int = 2, **parts) -> Path:
        """``<name>.json`` (``{"environment": env, "rows": rows, **parts}``), ``<name>.md`` (``table``) and
        ``<name>.csv`` (``rows``) in ``folder``; returns the markdown's path."""
        folder.mkdir(parents=True, exist_ok=True)
        result = {"environment": env, "rows": rows, **parts}
        (folder / f"{self.name}.json").write_text(json.dumps(result, indent=indent, default=str) + "\n")
        write_csv(folder / f"{self.name}.csv", rows)
        path = folder / f"{self.name}.md"
        path.write_text(table)
        return path


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV, one line each, the columns every row's keys in order of first appearance (a nested value as
    its JSON)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list, tuple)) else v for k, v in row.items()})


def alternate(turns: dict[str, Callable[[], float | list[float]]], rounds: int) -> dict[str, list[float]]:
    """The alternating timer: ``rounds`` rounds of every run's turn in order (a turn gives one time or several), so
    that whatever else the machine does falls on each run alike; each run's times, for its median."""
    times: dict[str, list[float]] = {name: [] for name in turns}
    for _ in range(rounds):
        for name, turn in turns.items():
            got = turn()
            times[name] += got if isinstance(got, list) else [got]
    return times


def results_folder(out: Path | None, device: str) -> Path:
    """``out``, or the committed results' folder of ``device`` ("cpu", "h100", ...); made if missing."""
    folder = out or RESULTS / device_slug(device)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def read_results(folder: Path, name: str) -> dict | None:
    """What :meth:`Bench.write` wrote as ``<name>.json`` in ``folder``, or ``None`` if nothing is there."""
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def kept_rows(old: dict, part: str, dates: str, group, ran: set) -> tuple[list[dict], dict[str, str]]:
    """The rows of ``old[part]`` (a results file's contents) whose ``group(row)`` is not in ``ran``, and each kept
    group's run date: the one ``old["environment"][dates]`` gives it (kept itself from an earlier run), else the old
    run's. For a benchmark that reruns some of its models or sections and keeps the others."""
    kept = [r for r in old[part] if group(r) not in ran]
    earlier, date = old["environment"].get(dates, {}), old["environment"]["date"]
    return kept, {g: earlier.get(g, date) for g in dict.fromkeys(map(group, kept))}
